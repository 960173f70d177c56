"""``python -m benchmarks.bench_tf_ps``: the TF parameter-server bench alone."""

import sys

from benchmarks.bench_tf_ps import main

sys.exit(main(sys.argv[1:]))
