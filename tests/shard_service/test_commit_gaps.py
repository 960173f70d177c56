"""A staged commit that a later commit names as its previous, and that never arrives, is loud (issue 26, item 4).

A real master: the gap is in status, ``dataset describe`` and ``/metrics`` with its age, survives a SIGKILL of
the master with its age, and closes when the late commit arrives. The core on a settable clock: a gap open
longer than ``sr.commit_gap_ms`` fails the dataset naming producer, part and epoch; with
``sr.on_data_loss=skip`` it is counted and shown instead; a resume gives it one more bound or skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from streamrover.shard_service import DatasetSpec, FailedPreconditionError, InvalidArgumentError, ShardClient
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import SourceKind
from streamrover.testing.procs import MasterProcess
from tests.shard_service.fake_clock import Clock


def _metrics(master: MasterProcess) -> str:
    request = urllib.request.Request(f"{master.dashboard_url.split('#')[0].rstrip('/')}/metrics",
                                     headers={"Authorization": f"Bearer {master.token}"})  # fmt: skip
    return str(urllib.request.urlopen(request, timeout=10).read().decode())


def _gaps(client: ShardClient) -> list[tuple[str, str, int, int, bool]]:
    return [(g.producer, g.part, g.epoch, g.next_epoch, g.skipped) for g in client.describe_dataset("s").commit_gaps]


def test_a_gap_is_shown_with_its_age_survives_a_restart_and_closes_on_the_late_commit(
    tmp_path: Path, master: MasterProcess
) -> None:
    client = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    try:
        client.register_dataset(DatasetSpec("s", "staged://s", "parquet", {"sr.staging_dir": str(tmp_path / "st")}))
        client.commit_staged("s", "job", "0", 5, [])  # the first of (job, 0): no previous, no gap
        client.commit_staged("s", "job", "0", 7, [], previous_epoch=6)  # 6's commit is late (Flink retries it)
        client.commit_staged("s", "job", "1", 7, [], previous_epoch=5)
        assert _gaps(client) == [("job", "0", 6, 7, False), ("job", "1", 5, 7, False)]
        assert not client.describe_dataset("s").failed, "a gap is not loss before its bound"
        metrics = _metrics(master)
        assert 'streamrover_dataset_commit_gaps{dataset="s",state="open"} 2.0' in metrics
        assert 'streamrover_commit_gap_age_seconds{dataset="s",epoch="6",part="0",producer="job",state="open"}' in (
            metrics
        )
        env = {**os.environ, "STREAMROVER_TOKEN": master.token}
        shown = subprocess.run([sys.executable, "-m", "streamrover.cli", "dataset", "describe", "s", "--master",
                                master.address], capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "commit gaps" in shown.stdout and "open" in shown.stdout, shown.stdout

        age = client.describe_dataset("s").commit_gaps[0].age_seconds
        master.kill()
        master.start()
        after = client.describe_dataset("s").commit_gaps
        assert [(g.epoch, g.next_epoch) for g in after] == [(6, 7), (5, 7)], "gaps are journalled"
        assert after[0].age_seconds >= age, "a restarted master keeps a gap's age"

        client.commit_staged("s", "job", "0", 6, [], previous_epoch=5)  # the late commit: gap closed, none opened
        client.commit_staged("s", "job", "0", 7, [], previous_epoch=6)  # a replay of a committed key changes nothing
        assert _gaps(client) == [("job", "1", 5, 7, False)]
        client.commit_staged("s", "job", "1", 5, [], previous_epoch=3)  # closes 5, opens 3 (its own previous)
        assert _gaps(client) == [("job", "1", 3, 5, False)]
        with pytest.raises(InvalidArgumentError, match="previous_epoch must be >= 0 and below epoch 9"):
            client.commit_staged("s", "job", "1", 9, [], previous_epoch=9)
        assert 'streamrover_dataset_commit_gaps{dataset="s",state="open"} 1.0' in _metrics(master)
    finally:
        client.close()


def _core(tmp_path: Path, clock: Clock, **options: str) -> ShardCore:
    core = ShardCore(Journal(tmp_path / "j.db"), clock=clock)
    spec = DatasetSpec("s", "staged://s", "parquet", {"sr.commit_gap_ms": "60000", **options})
    core.register_dataset(spec, SourceKind.STREAM, [], "[]")
    return core


def test_a_gap_past_its_bound_fails_the_dataset_naming_it(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock)
    core.staged.commit_staged("s", "job", "2", 4, [], previous=None)
    core.staged.commit_staged("s", "job", "2", 9, [], previous=8)
    opened = clock.now
    assert core.next_deadline() == opened + 60.0, "the reaper's timer wakes for the gap's bound"
    clock.now += 59.9
    assert core.expire() == 0 and not core.dataset("s").failed
    clock.now += 0.2
    assert core.expire() == 1, "the reaper's expiry acts on the gap"
    assert [(g.producer, g.part, g.epoch, g.skipped) for g in core.staged.gaps.of("s")] == [("job", "2", 8, False)]
    reason = core.dataset("s").failed
    assert "producer 'job', part '2', epoch 8 never arrived" in reason and "epoch 9" in reason
    assert "sr.commit_gap_ms=60000" in reason and "streamrover dataset resume s" in reason
    with pytest.raises(FailedPreconditionError, match="epoch 8 never arrived"):
        core.staged.commit_staged("s", "job", "2", 10, [], previous=9)  # a failed dataset takes no commits
    assert core.next_deadline() is None, "a failed dataset's gaps are no longer timed"

    # resumed: one more bound for the commit to arrive, from now
    assert core.streams.resume_dataset("s") and core.staged.resume_gaps("s", skip=False) == 1
    assert core.next_deadline() == clock.now + 60.0
    core.journal.close()
    reopened = ShardCore(Journal(tmp_path / "j.db"), clock=clock)  # a restarted master: same gap, same age
    assert [(g.epoch, g.opened_at) for g in reopened.staged.gaps.of("s")] == [(8, clock.now)]
    reopened.staged.commit_staged("s", "job", "2", 8, [], previous=4)
    assert reopened.staged.gaps.of("s") == [] and reopened.next_deadline() is None


def test_with_skip_a_gap_past_its_bound_is_counted_and_shown_not_failed(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock, **{"sr.on_data_loss": "skip"})
    core.staged.commit_staged("s", "q", "driver", 3, [], previous=2)
    core.staged.commit_staged("s", "q", "driver", 6, [], previous=5)
    clock.now += 61.0
    assert len(core.staged.expire_gaps()) == 2
    assert not core.dataset("s").failed
    assert [(g.epoch, g.skipped) for g in core.staged.gaps.of("s")] == [(2, True), (5, True)]
    assert core.next_deadline() is None and core.staged.expire_gaps() == [], "a skipped gap is counted once"
    core.staged.commit_staged("s", "q", "driver", 5, [], previous=4)  # late after all: no longer missing
    assert [(g.epoch, g.skipped) for g in core.staged.gaps.of("s")] == [(2, True), (4, False)]

    # a failed dataset resumed with --skip-lost: its open gaps are skipped, not timed again
    core.dataset("s").spec.options["sr.on_data_loss"] = "fail"
    clock.now += 61.0
    core.staged.expire_gaps()
    assert "epoch 4 never arrived" in core.dataset("s").failed
    assert core.streams.resume_dataset("s", skip_lost=True) and core.staged.resume_gaps("s", skip=True) == 1
    assert all(g.skipped for g in core.staged.gaps.of("s")) and core.next_deadline() is None


def test_a_bad_bound_is_refused_at_registration(tmp_path: Path, master: MasterProcess) -> None:
    client = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    try:
        with pytest.raises(InvalidArgumentError, match="sr.commit_gap_ms must be a positive integer"):
            client.register_dataset(DatasetSpec("s", "staged://s", "parquet", {"sr.commit_gap_ms": "5m"}))
    finally:
        client.close()
