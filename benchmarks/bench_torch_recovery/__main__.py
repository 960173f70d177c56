"""``python -m benchmarks.bench_torch_recovery``: the torch recovery bench alone."""

import sys

from benchmarks.bench_torch_recovery import main

sys.exit(main(sys.argv[1:]))
