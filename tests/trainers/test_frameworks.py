"""Unmodified Lightning and HF Trainer scripts (plus the README's lines) under ``dlrover-run --ckpt-dir``.

The only worker is SIGKILLed in the middle of an epoch, between two snapshots; the agent restarts it,
and it must resume from this node's shared memory at the newest snapshot's step, the global step
going on exactly: the steps of the first run up to the snapshot, then the second run's, are
0, 1, ..., max_steps - 1 (no gap, no repeat). At the step it resumes, the weights, the optimizer state and
the learning rate are the first run's at that step, bit for bit (and for the HF Trainer, which replays the same
batches and RNG, at every step both runs made). The final checkpoint is durable on storage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.ckpt import list_checkpoints
from streamrover.testing.procs import python_env
from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob, records_table

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
DLROVER_RUN = Path(sys.executable).parent / "dlrover-run"
MAX_STEPS, PAUSE_AT, EVERY = 30, 17, 5  # the scripts snapshot every 5 steps, persist every 2nd snapshot


def _steps(path: Path) -> tuple[list[int], list[str]]:
    """The global steps a run logged, and the fingerprint of its state at each."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [int(step) for step, _ in rows], [fp for _, fp in rows]


def _killed_mid_epoch(tmp_path: Path, script: str, replays_exactly: bool) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    env = python_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    cmd = [str(DLROVER_RUN), "--standalone", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "2",
           "--monitor-interval", "0.2", "--ckpt-dir", str(ckpt), str(HERE / script), "--out", str(out),
           "--max-steps", str(MAX_STEPS), "--pause-at", str(PAUSE_AT)]  # fmt: skip
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        paused = out / "paused"
        wait_until(lambda: paused.exists() and paused.read_text() != "", 240, f"{script} to reach step {PAUSE_AT}")
        os.kill(int(paused.read_text()), signal.SIGKILL)
        assert agent.wait(timeout=240) == 0, (tmp_path / "agent.log").read_text()[-4000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    logs = (tmp_path / "agent.log").read_text()
    (first, first_fp), (second, second_fp) = _steps(out / "steps-0.txt"), _steps(out / "steps-1.txt")
    snapshot = PAUSE_AT // EVERY * EVERY  # 15: a snapshot persisted only by the agent after the kill
    assert first == list(range(PAUSE_AT + 1)), logs[-4000:]
    assert f"rank 0 resumes at step {snapshot} from memory" in logs, logs[-4000:]
    assert first[:snapshot] + second == list(range(MAX_STEPS)), (first, second)
    assert second_fp[0] == first_fp[snapshot], "the resumed weights, optimizer state or learning rate differ"
    if replays_exactly:  # the same batches and RNG after the resume: the steps the first run made again, bit for bit
        assert second_fp[: len(first) - snapshot] == first_fp[snapshot:], "the steps after the resume differ"
    final = list_checkpoints(str(ckpt))[-1]
    assert (final.step, final.complete) == (MAX_STEPS, True), "the final checkpoint is durable"


def test_lightning_script_resumes_from_shared_memory_after_a_sigkill(tmp_path: Path) -> None:
    # Lightning does not put a shuffled loader back at its batch mid-epoch: the steps after the resume see other batches
    _killed_mid_epoch(tmp_path, "lightning_script.py", replays_exactly=False)


def test_hf_trainer_script_resumes_from_shared_memory_after_a_sigkill(tmp_path: Path) -> None:
    # the Trainer skips the batches trained, and the snapshot holds the RNG and the scheduler: an exact replay
    _killed_mid_epoch(tmp_path, "hf_script.py", replays_exactly=True)


def test_lightning_fed_by_a_stream_resumes_at_the_cursor_and_the_ledger_is_exact(tmp_path: Path) -> None:
    """The stream half: each step acks its records, each snapshot carries the cut, the resume resets the cursor."""
    records = 3_000
    root = tmp_path / "data"
    root.mkdir()
    ids = np.random.default_rng(1).permutation(records)
    for i, part in enumerate(np.array_split(ids, 2)):
        pq.write_table(pa.table(records_table(part)), root / f"part-{i}.parquet", row_group_size=500)
    job = TorchJob(tmp_path, str(root), records_per_shard=500)
    job.start()
    try:
        job.start_agent("n0", "1", 1, ["--records", str(records), "--out", str(job.out), "--pause-at", str(PAUSE_AT)],
                        script=HERE / "lightning_stream.py")  # fmt: skip
        paused = job.out / "paused"
        wait_until(lambda: paused.exists() and paused.read_text() != "", 240, f"step {PAUSE_AT}")
        os.kill(int(paused.read_text()), signal.SIGKILL)
        wait_until(lambda: job.agents["n0"].poll() is not None, 240, "the agent to finish")
        assert job.agents["n0"].returncode == 0, job.logs()
        ledger = job.ledger()
        assert ledger is not None and ledger.shape == (records,), job.logs()
        assert np.all(ledger == 1), f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated"
        assert f"rank 0 resumes at step {PAUSE_AT // EVERY * EVERY} from memory" in job.logs()
        with job.admin() as admin:
            assert admin.get_cursor()[0].size() == records, "the final checkpoint's cut covers every record"
    finally:
        job.stop()
