"""Node health: the node check's cost, and the job's step rate under one throttled node, without and with replacement.

One ``streamrover run`` of the three-node job of tests/health/job.py (one worker per node; each step 30 ms
of CPU in a 200 ms period, so a healthy node keeps the period and a node held to 10% of a core by a CPU
cgroup cannot), ``health.node_check`` on and ``straggler_policy: replace``:

1. node n2's agent is put into a 10% cgroup at launch: the node check fails it and it is relaunched;
2. after 12 s of healthy training slot 1's node is throttled to 10%: the master flags it, the supervisor
   replaces it, and the job trains on.

Rates are rank 0's steps per second (``steps.txt``), all from the same run: **healthy** (the 10 s before the
throttle), **throttled** (from 2 s after the throttle to the replacement: the rate without replacement),
**replaced** (from 3 s after the new group's first step to the end). Printed: each as a ratio to healthy,
the straggler's detection time, the check's cost (its probes, and its wall time with the wait for the peers)
per node, and whether the ledger is exact (the run fails if not). Needs root (cgroups) and ~4 min.

``python -m benchmarks health``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._common import environment, load, table


def run(keep: str | None = None) -> int:
    from tests.brokers.kafka import KafkaBroker
    from tests.health.job import RECORDS, THROTTLE, health_spec, run_health_job
    from tests.operator.runner import RunningJob

    print(environment())
    print(f"load: {load()}")
    with tempfile.TemporaryDirectory(prefix="health-") if keep is None else contextlib.nullcontext(keep) as tmp:
        broker = KafkaBroker(Path(tmp) / "kafka")
        broker.start()
        job = RunningJob(Path(tmp), health_spec("health", broker, Path(tmp) / "out"))
        try:
            seen = run_health_job(job)
            ledger = job.ledger()
        finally:
            job.stop()
            broker.stop()
    exact = seen.exit_code == 0 and ledger is not None and ledger.shape == (RECORDS,) and bool(np.all(ledger == 1))
    rows = [[node, f"{c['compute_s']:.3f}", f"{c['allreduce_s']:.3f}", f"{c['ratio']:.2f}" if c["ratio"] else "-",
             "passed" if c["passed"] else "FAILED", f"{c['cost_s']:.2f}"]
            for node, c in sorted(seen.check.items())]  # fmt: skip
    print(table(["node", "compute probe s", "all-reduce probe s", "x peers' median", "check", "check cost s"], rows))
    healthy = seen.healthy_rate or float("nan")
    print(table(["phase", "steps/s", "x healthy"], [
        ["healthy (3 nodes)", f"{seen.healthy_rate:.2f}", "1.00"],
        [f"one node at {THROTTLE:.0%} of a core, not replaced", f"{seen.throttled_rate:.2f}",
         f"{seen.throttled_rate / healthy:.2f}"],
        ["after replacement", f"{seen.recovered_rate:.2f}", f"{seen.recovered_rate / healthy:.2f}"],
    ]))  # fmt: skip
    print(f"straggler {seen.throttled_node} flagged {seen.flagged_after:.1f} s after its throttle "
          f"({seen.straggler_event}); the group with its replacement stepping {seen.replaced_after:.1f} s after the "
          f"throttle; "
          f"ledger {'exact' if exact else 'WRONG'}")  # fmt: skip
    return 0 if exact else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks health", description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default=None, help="a new directory to run in and keep (logs, steps.txt)")
    args, _ = parser.parse_known_args(argv)
    return run(args.keep)
