"""Run the benchmarks: ``python -m benchmarks [NAME...] [OPTIONS]``.

NAME is a module ``benchmarks/bench_NAME.py``, or a folder ``benchmarks/bench_NAME/`` for a bench with helpers
(default: all of them, in name order).
Every other argument (``--quick`` for a smoke-sized run, ...) is passed to each
module's ``main(argv)``.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path


def available() -> list[str]:
    here = Path(__file__).resolve().parent
    benches = [p for p in here.glob("bench_*") if p.suffix == ".py" or (p / "__init__.py").is_file()]
    return sorted(p.stem.removeprefix("bench_") for p in benches)


def _takes_value(arg: str) -> bool:
    return arg.startswith("--") and "=" not in arg


def main(argv: list[str]) -> int:
    known = available()
    names = [a.removeprefix("bench_") for a in argv if a.removeprefix("bench_") in known]
    passed = [a for a in argv if a.removeprefix("bench_") not in known]
    if passed in (["-h"], ["--help"]):
        print(__doc__)
        print("benchmarks:", ", ".join(known))
        return 0
    # a bare word is an option's value when it follows "--option" (without "="); otherwise a misspelt name
    stray = [a for i, a in enumerate(passed) if not a.startswith("-") and not (i and _takes_value(passed[i - 1]))]
    if stray:
        print(f"unknown benchmark(s) {', '.join(stray)}; available: {', '.join(known)}", file=sys.stderr)
        return 2
    selected = names or known
    status = 0
    for name in selected:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        print(f"\n===== benchmarks.bench_{name} =====", flush=True)
        t0 = time.perf_counter()
        rc = module.main(passed)
        print(f"===== {name}: {time.perf_counter() - t0:.1f}s =====", flush=True)
        status = status or int(rc or 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
