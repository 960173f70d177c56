"""streamrover benchmarks: each ``bench_*.py`` module has a ``main(argv)`` that prints ratios against a peer.

Benchmarks are not tests: they pass or fail nothing, they print numbers measured
against a baseline run on the same machine in the same run. Run them with
``make bench`` or ``python -m benchmarks [NAME...] [--quick]``.
"""

import streamrover  # noqa: F401  (first: every bench process, peers included, gets streamrover's gRPC I/O choice)
