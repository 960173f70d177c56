"""Graceful scale-in: a node that leaves hands its leases back at once; the group goes on exactly once.

Two ``dlrover-run`` agents (``--nnodes 1:2``, one worker each) train the ledger job from parquet;
the master's lease TTL is 600 s, far longer than the test. Mid-run the second node is told to leave
as the platforms tell it (SIGTERM to its agent: torchelastic passes SIGTERM to the workers). Its
worker flushes its queued acks, leaves the shard service (every lease it holds goes back now) and
exits; the first node re-rendezvouses alone, restores the newest checkpoint and finishes.

Observable: the leaving worker disappears from the master's status long before its leases could
expire (a worker that just died would stay listed, holding leases, until the TTL ran out), and the
ledger counts every record exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob
from tests.trainers.test_single_node import _parquet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RECORDS = 20_000
LEASE_TTL = 600.0


def _workers_of(job: TorchJob, node: str) -> list[tuple[str, int]]:
    with job.admin() as admin:
        return [(w.name, w.leases) for w in admin.status().workers if w.name.endswith(f"@{node}")]


def test_a_leaving_node_hands_its_leases_back_and_the_ledger_is_exact(tmp_path: Path) -> None:
    _parquet(tmp_path / "data", RECORDS)
    job = TorchJob(tmp_path, str(tmp_path / "data"), records_per_shard=500, lease_ttl=LEASE_TTL)
    job.start()
    try:
        args = ["--records", str(RECORDS), "--batch-size", "64", "--out", str(job.out)]
        for node in ("n0", "n1"):
            job.start_agent(node, "1:2", 1, args)
        wait_until(lambda: len(job.workers("n0")) == 1 and len(job.workers("n1")) == 1, 240, "both nodes training")
        wait_until(lambda: job.acked() >= RECORDS * 0.2, 240, "20% of the records acked")
        wait_until(lambda: any(leases for _, leases in _workers_of(job, "n1")), 120, "n1's worker holding a lease")
        signalled = time.monotonic()
        job.agents["n1"].send_signal(signal.SIGTERM)  # the node leaves (what a platform's stop_node does)
        wait_until(lambda: not _workers_of(job, "n1"), 120,
                   f"n1's worker to leave the master (not wait out the {LEASE_TTL:.0f} s lease TTL)")  # fmt: skip
        handed_back = time.monotonic() - signalled
        print(f"\nSIGTERM -> the leaving worker's leases handed back and it left the master: {handed_back:.2f} s")
        assert job.agents["n1"].wait(timeout=120) is not None
        agent_log = (tmp_path / "agent-n1.log").read_text(errors="replace")
        assert "left on SIGTERM: acks flushed" in agent_log, (  # the end of the log says how the worker ended
            "n1's worker did not log its graceful leave; its log ends:\n" + "\n".join(agent_log.splitlines()[-40:])
        )
        wait_until(lambda: job.agents["n0"].poll() is not None, 400, "the remaining node to finish")
        assert job.agents["n0"].returncode == 0, job.logs()
        ledger = job.ledger()
        assert ledger is not None and ledger.shape == (RECORDS,), job.logs()
        assert np.all(ledger == 1), f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} doubled"
    finally:
        job.stop()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["leaves", "is-killed"])
def test_a_node_that_leaves_while_its_group_forms_does_not_stall_the_others(tmp_path: Path, how: int) -> None:
    """n1's worker stops before ``init_process_group`` (``--hold-node``): n0's waits there for it, and no
    collective exists yet that could fail when n1 goes. n1's agent is SIGTERMed (its worker, with no handler
    yet, dies of it) or SIGKILLed (its worker is left behind, never connected). torchelastic alone would leave
    n0 waiting out gloo's 30 min timeout; the rendezvous drops n1 once its keep-alive stops, and n0 restarts
    alone from that and finishes, every record in the ledger once.
    """
    _parquet(tmp_path / "data", RECORDS // 4)
    job = TorchJob(tmp_path, str(tmp_path / "data"), records_per_shard=500)
    job.start()
    held = [job.out / f"held-n1-rank{r}" for r in (0, 1)]
    try:
        args = ["--records", str(RECORDS // 4), "--batch-size", "64", "--out", str(job.out), "--hold-node", "n1"]
        for node in ("n0", "n1"):
            job.start_agent(node, "1:2", 1, args)
        wait_until(lambda: any(p.exists() and p.read_text() for p in held), 240, "n1's worker held in a group of two")
        signalled = time.monotonic()
        job.agents["n1"].send_signal(how)
        job.agents["n1"].wait(timeout=120)
        wait_until(lambda: job.agents["n0"].poll() is not None, 240, f"n0 to finish alone\n{job.logs()}")
        print(f"\nn1 gone ({signal.Signals(how).name}) while the group formed -> n0 finished alone "
              f"{time.monotonic() - signalled:.1f} s later")  # fmt: skip
        assert job.agents["n0"].returncode == 0, job.logs()
        assert "a node left rendezvous round" in (tmp_path / "agent-n0.log").read_text(errors="replace")
        ledger = job.ledger()
        assert ledger is not None and np.all(ledger == 1), job.logs()
    finally:
        for p in held:  # a SIGKILLed agent leaves its held worker behind (it never armed a parent-death signal)
            if p.exists() and p.read_text():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p.read_text()), signal.SIGKILL)
        job.stop()
