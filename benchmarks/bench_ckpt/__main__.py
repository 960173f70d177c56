"""``python -m benchmarks.bench_ckpt --role ...``: the bench's child processes (one state size, one restore)."""

import sys

from benchmarks.bench_ckpt import main

sys.exit(main(sys.argv[1:]))
