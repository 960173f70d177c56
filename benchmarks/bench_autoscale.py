"""Autoscale: a producer rate step, the autoscaled job against a fixed job sized for the peak, in one run.

Both jobs are ``streamrover run`` of the paced torch ledger job (tests/operator/ratestep.py: one
worker per node, a node trains at most 160 records/s: a modelled step time stands for the compute
this 2-core machine cannot give three nodes) on a 4-partition Kafka 4 topic, one after the other on
the same broker. The rate profile is the same for both: 80 records/s for ``--low`` s, 320/s (4x) for
``--high`` s, 80/s for ``--tail`` s. The autoscaled job has nodes 1:3 and a lag target of 2,000
records (cooldown 10 s); the fixed job has 3 nodes throughout (what the peak needs).

Measured over the profile (the job's start-up before it excluded for both): node-seconds (nodes
launched and not ended, integrated over time), lag record-seconds (the master's lag, integrated),
the peak lag, and for the autoscaled job the time from the rate step to the lag back under the target
(once it had gone above, after its peak). Printed: the ratio of node-seconds (goal <= 0.6) and the lag-back time (goal
<= 60 s). Each job's ledger must be exact, or the run fails.

``python -m benchmarks autoscale`` (~15 min: two jobs of ~6 min); ``--quick`` shortens the profile.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import environment, load, table

TARGET = 2_000


def _job(tmp: Path, broker: Any, name: str, autoscaled: bool, phases: tuple[float, float, float]) -> dict[str, Any]:
    from tests.helpers import wait_until
    from tests.operator.ratestep import NODE_RATE, Monitor, RateProducer, rate_step_spec, scale_out_phases
    from tests.operator.runner import RunningJob

    low_rate = NODE_RATE / 2
    auto = {"target_lag_records": TARGET, "cooldown_seconds": 10} if autoscaled else None
    out = tmp / name / "out"
    (tmp / name).mkdir(parents=True)
    spec, topic = rate_step_spec(name, broker, out, 400_000, "1:3" if autoscaled else "3", auto)
    spec["restart"] = {"per_node": 20}
    job = RunningJob(tmp / name, spec)
    producer = RateProducer(broker, topic, low_rate)
    monitor = Monitor(job)
    try:
        job.start()
        monitor.start()
        nodes = ["n0"] if autoscaled else ["n0", "n1", "n2"]
        wait_until(lambda: all(job.running(n) for n in nodes), 600, f"{name}: its nodes up")
        producer.send_now(200)
        wait_until(lambda: job.acked() >= 200, 600, f"{name}: training")
        t0 = time.monotonic()
        producer.start()
        time.sleep(phases[0])  # the rate profile is a schedule in time, the same for both jobs
        raised = producer.set_rate(4 * low_rate)
        time.sleep(phases[1])
        producer.set_rate(low_rate)
        time.sleep(phases[2])
        t1 = time.monotonic()
        produced = producer.finish(out / "produced")
        code = job.wait(timeout=900)
        ledger = job.ledger()
        exact = code == 0 and ledger is not None and bool(np.all(ledger[:produced] == 1))
        exact = exact and ledger is not None and not ledger[produced:].any()
        if not exact:
            print(job.logs()[-6000:])
        node_s, lag_s = monitor.integrals(t0, t1)
        inside = [s for s in monitor.samples if t0 <= s.at <= t1]
        above = next((s for s in inside if s.at >= raised and s.lag > TARGET), None)
        # back under the target after the peak, not at the first dip below it (a sample between two bursts of acks)
        peak = max((s for s in inside if s.at >= raised), key=lambda s: s.lag, default=None)
        back = next((s for s in inside if above is not None and peak is not None and s.at > peak.at
                     and s.lag < TARGET), None)  # fmt: skip
        with open(tmp / name / "samples.csv", "w") as f:  # the trace (kept with --keep): s from the step
            f.write("s_after_step,nodes,training,lag\n")
            f.writelines(f"{s.at - raised:.2f},{s.nodes},{s.running},{s.lag}\n" for s in monitor.samples)
        phases_s = scale_out_phases(job)
        if phases_s is not None:
            print(f"{name}: the first scale-out's pause, seconds from the decision: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in phases_s.items()))  # fmt: skip
        return {
            "name": name, "node_s": node_s, "lag_s": lag_s, "peak": max((s.lag for s in inside), default=0),
            "above": above is not None, "back": (back.at - raised) if back else None, "produced": produced,
            "exact": exact, "max_nodes": max((s.nodes for s in inside), default=0), "seconds": t1 - t0,
        }  # fmt: skip
    finally:
        monitor.stop()
        job.stop()


def run(phases: tuple[float, float, float], jobs: tuple[str, ...] = ("autoscaled", "fixed"),
        keep: str | None = None) -> int:  # fmt: skip
    from tests.brokers.kafka import KafkaBroker

    print(environment())
    print(f"load: {load()}")
    with tempfile.TemporaryDirectory(prefix="autoscale-") if keep is None else contextlib.nullcontext(keep) as tmp:
        broker = KafkaBroker(Path(tmp) / "kafka")
        broker.start()
        try:
            results = [_job(Path(tmp), broker, name, name == "autoscaled", phases) for name in jobs]
        finally:
            broker.stop()
    rows = []
    for r in results:
        back = "never above" if not r["above"] else (f"{r['back']:.1f}" if r["back"] is not None else "not back")
        rows.append([r["name"], f"{r['seconds']:.0f}", r["max_nodes"], f"{r['node_s']:.0f}", f"{r['lag_s']:,.0f}",
                     f"{r['peak']:,}", back, f"{r['produced']:,}", "exact" if r["exact"] else "WRONG"])  # fmt: skip
    print(table(["job", "profile s", "max nodes", "node-s", "lag record-s", "peak lag", "step -> lag < target s",
                 "records", "ledger"], rows))  # fmt: skip
    if len(results) < 2:
        return 0 if all(r["exact"] for r in results) else 1
    auto, fixed = results
    ratio = auto["node_s"] / fixed["node_s"] if fixed["node_s"] else float("nan")
    back = "never" if auto["back"] is None else f"{auto['back']:.1f} s"
    print(f"node-seconds autoscaled / fixed for the peak: {ratio:.2f}x (goal <= 0.6); lag back under the target "
          f"{back} after the rate step (goal <= 60 s); lag record-s "
          f"{auto['lag_s'] / max(fixed['lag_s'], 1.0):.1f}x the fixed job's")  # fmt: skip
    return 0 if auto["exact"] and fixed["exact"] else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks autoscale", description=__doc__.splitlines()[0])
    parser.add_argument("--low", type=float, default=30.0, help="seconds at the low rate before the step")
    parser.add_argument("--high", type=float, default=90.0, help="seconds at 4x the rate")
    parser.add_argument("--tail", type=float, default=240.0, help="seconds at the low rate after it")
    parser.add_argument("--quick", action="store_true", help="a shorter profile (20 / 60 / 120 s)")
    parser.add_argument("--jobs", default="autoscaled,fixed", help="which jobs to run (a partial run: no ratio)")
    parser.add_argument("--keep", default=None,
                        help="a new directory to run in and keep (the jobs' logs; samples.csv: nodes and lag)")
    args, _ = parser.parse_known_args(argv)
    phases = (20.0, 60.0, 120.0) if args.quick else (args.low, args.high, args.tail)
    jobs = tuple(j for j in args.jobs.split(",") if j)
    if not jobs or set(jobs) - {"autoscaled", "fixed"}:
        parser.error(f"--jobs: {args.jobs!r}: name autoscaled and/or fixed")
    return run(phases, jobs, args.keep)
