"""A new run never restores another run's shared-memory snapshot (real master processes, a file dataset).

Flash snapshots outlive every process on purpose (a restarted trainer maps them), under a name derived from
the checkpoint URL and the job name only. Run 1 trains to the end, its storage and journal are wiped, and run 2
(same URL, same job, a fresh master) starts: its master refuses run 1's snapshot (FAILED_PRECONDITION: a cut
of another journal's run), the trainer discards it and starts fresh, and run 2's model holds every record
exactly once. A master restarted on its own journal still accepts its run's snapshot.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from streamrover.ckpt import Checkpointer, LoadedFrom, SnapshotRefusedError, namespace_for, purge_shared_memory
from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, FailedPreconditionError, LeaseLostError, ShardClient
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from streamrover.testing.procs import MasterProcess
from streamrover.trainers.api import restore_before_lease
from tests.helpers import write_parquet_dataset

ROWS = 4_000
JOB = "stale-snapshot"


def _train(
    client: ShardClient, ckpt: Checkpointer, state: dict[str, np.ndarray], step: int, stop_at: int | None
) -> int:
    """Consume ``rows`` to its end (or ``stop_at`` steps), a memory snapshot every 2 steps (persisted every 4)."""
    for shard in client.shards("rows"):
        try:
            for batch in shard.batches(250):
                np.add.at(state["seen"], batch.records.column("id").to_numpy(), 1)
                step += 1
                shard.ack(batch.end, step=step)
                if step % 2 == 0:
                    ckpt.save(step, state, persist=step % 4 == 0)
                if stop_at is not None and step >= stop_at:
                    return step
        except LeaseLostError:  # revoked by a restore: read again by the next lease
            continue
    return step


def _run(master: MasterProcess, data: Path, url: str) -> tuple[ShardClient, Checkpointer]:
    client = ShardClient(master.address, token=master.token, timeout=60)
    client.register_dataset(DatasetSpec("rows", str(data), records_per_shard=500))
    return client, _checkpointer(url, client)


def _checkpointer(url: str, client: ShardClient) -> Checkpointer:
    """The node's saver is a process that outlives trainers (one the test loses ends when idle for a minute)."""
    return Checkpointer(url, binder=client, job=JOB, linger=60)


def _kill_saver(ckpt: Checkpointer) -> None:
    """SIGKILL the node's saver (as a test's or a platform's teardown does): the snapshots stay in /dev/shm."""
    ckpt.wait(timeout=60)
    saver = ckpt.saver_pid
    assert saver is not None
    os.kill(saver, signal.SIGKILL)
    try:
        os.waitpid(saver, 0)
    except ChildProcessError:  # reaped already by subprocess's clean-up of the Popen the checkpointer dropped
        pass


def shm_names(url: str) -> list[str]:
    prefix = f"srckpt-{namespace_for(url, JOB)}-"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def _restore(client: ShardClient, ckpt: Checkpointer) -> tuple[int, dict[str, np.ndarray], str]:
    loaded = restore_before_lease(lambda: ckpt.load(restore=True), client)
    if loaded is None:
        return 0, {"seen": np.zeros(ROWS, np.int32)}, "fresh"
    return loaded.step, {k: np.array(v) for k, v in loaded.state.items()}, loaded.source.value


def test_a_new_run_never_restores_an_old_runs_snapshot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data, url = tmp_path / "data", str(tmp_path / "ckpt")
    write_parquet_dataset(data, ROWS, files=2, row_group_size=500)
    purge_shared_memory(namespace_for(url, JOB))
    old = MasterProcess(tmp_path / "master-1", lease_ttl=2.0)
    new = MasterProcess(tmp_path / "master-2", lease_ttl=2.0)
    try:
        # Run 1: to the end; then its processes are SIGKILLed (the node's saver too, as a test's or a platform's
        # teardown does): its snapshots stay in shared memory.
        old.start()
        client, ckpt = _run(old, data, url)
        step, state, _ = _restore(client, ckpt)
        step = _train(client, ckpt, state, step, stop_at=None)
        assert np.all(state["seen"] == 1) and step == ROWS // 250
        _kill_saver(ckpt)
        ckpt.close()
        client.close()
        old.stop()
        assert shm_names(url), "run 1's snapshots must outlive its processes"
        shutil.rmtree(url)  # run 1's storage is wiped; so is its journal (run 2's master has a fresh state dir)

        # Run 2: same checkpoint URL and job name on this node, a fresh master.
        new.start()
        client, ckpt = _run(new, data, url)
        with pytest.raises(SnapshotRefusedError, match="not of this run") as refused:  # what Checkpointer.load catches
            client.restore_cursor(DataCursor(), from_memory=True, snapshot_run="0123456789abcdef")
        assert isinstance(refused.value, FailedPreconditionError), "still the shard service's error too"
        with caplog.at_level(logging.WARNING, logger="streamrover.ckpt.checkpointer"):
            step, state, source = _restore(client, ckpt)
        assert source == "fresh", f"run 2 restored run 1's snapshot of step {step} (from {source})"
        assert "not of this run" in caplog.text, caplog.text
        assert ckpt.engine.newest() is None, "the refused snapshot must be discarded (never persisted into run 2)"
        step = _train(client, ckpt, state, step, stop_at=7)  # snapshots at 2, 4 (persisted), 6

        # The master restarted on its own journal: the same run, so its snapshot (newer than storage's) is taken.
        new.kill()
        new.start()
        ckpt.close()  # the trainer restarts: its snapshots stay with the node's saver
        ckpt = _checkpointer(url, client)
        step, state, source = _restore(client, ckpt)
        assert (source, step) == (LoadedFrom.MEMORY.value, 6)
        _train(client, ckpt, state, step, stop_at=None)
        committed, acked = client.get_cursor()
        assert committed.size() <= acked.size() == ROWS
        assert np.all(state["seen"] == 1), f"{int((state['seen'] != 1).sum())} records not applied exactly once"
        _kill_saver(ckpt)
        ckpt.close(unlink=True)
        client.close()
    finally:
        old.stop()
        new.stop()
        purge_shared_memory(namespace_for(url, JOB))


def test_which_snapshots_a_master_takes_as_its_runs(tmp_path: Path) -> None:
    """``CutBook.check_snapshot``'s rules, in the core: the run id decides; without one, the cut says what it can."""
    spec = DatasetSpec("d", "mem://", records_per_shard=10)

    def core_at(path: Path) -> ShardCore:
        core = ShardCore(Journal(path / "j.db"), lease_ttl=5.0)
        core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, 30)], "[]")
        return core

    core = core_at(tmp_path / "a")
    w = core.join("w").id
    (grant,) = core.lease(w, "d").leases
    core.ack(w, grant.shard_id, grant.attempt, grant.end, step=1)
    cut = core.cut_prepare(1)
    run = core.cut_book.run_id
    assert run and core_at(tmp_path / "b").cut_book.run_id != run, "each journal is a run of its own"
    other = core.cut_book.cursor_of(cut.id).copy()
    other.add(next(iter(other.keys())), 10, 20)

    refused = [
        (cut.cursor, cut.id, "0123456789abcdef"),  # another run's snapshot
        (cut.cursor, cut.id + 5, None),  # a snapshot from before run ids, of a cut this journal never prepared
        (other, cut.id, None),  # ... of a cut it remembers, with another cursor
    ]
    for cursor, cut_id, run_id in refused:
        with pytest.raises(FailedPreconditionError, match="not of this run"):
            core.restore(cursor, from_memory=True, snapshot_cut=cut_id, snapshot_run=run_id)
        assert core.committed == DataCursor() and len(core.acked_cursor().keys()) == 1, "nothing changed"

    core.journal.close()
    core = core_at(tmp_path / "a")  # the master restarted on its journal: the same run
    assert core.cut_book.run_id == run
    core.restore(cut.cursor, from_memory=True, snapshot_cut=cut.id, snapshot_run=run)
    assert core.committed == cut.cursor
    core.restore(cut.cursor, from_memory=True, snapshot_cut=cut.id)  # cut forgotten (the restore discarded it)
    core.restore(other, from_memory=True)  # nothing recorded to tell: taken, as before run ids
    assert core.committed == other
