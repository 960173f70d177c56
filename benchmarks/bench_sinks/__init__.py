"""Training as the downstream node of a stream job: each engine's sink against the same job without it.

Parts (``python -m benchmarks sinks [--part spark|flink]``), each a module ``benchmarks/bench_sinks/<part>.py``
with ``main(argv) -> int``; a part whose module is not there (its engine's sink not built) is reported
and skipped. Goals (issue 12): Spark with the sink vs a foreachBatch that only counts >= 0.7; Flink with
the sink vs a DiscardingSink >= 0.7; a Flink checkpoint's completion to its shards leasable p99 <= 1 s.
"""

from __future__ import annotations

import argparse
import importlib

PARTS = ("spark", "flink")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sinks")
    parser.add_argument("--part", choices=PARTS, action="append", help="default: every part")
    args, rest = parser.parse_known_args(argv)
    status = 0
    for part in args.part or PARTS:
        try:
            module = importlib.import_module(f"benchmarks.bench_sinks.{part}")
        except ModuleNotFoundError as exc:
            if exc.name != f"benchmarks.bench_sinks.{part}":
                raise
            print(f"\n-- sinks/{part}: not built here (no benchmarks/bench_sinks/{part}.py)")
            continue
        print(f"\n-- sinks/{part}", flush=True)
        status = status or int(module.main(rest) or 0)
    return status
