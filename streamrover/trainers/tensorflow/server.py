"""A parameter-server or worker task: ``python -m streamrover.trainers.tensorflow.server --job ps --index 0``.

A plain ``tf.distribute.Server`` for the cluster spec in ``$STREAMROVER_TF_CLUSTER`` (or
``--cluster``); it prints ``READY`` once it listens and serves until killed. It dies with its
launcher (``PR_SET_PDEATHSIG``), so no orphan keeps a port. It holds no state a restart must keep:
the chief restores the variables.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from streamrover._libc import set_parent_death_signal
from streamrover.trainers.tensorflow.api import CLUSTER, ClusterConfigError, ClusterSpec


def _die_with_parent() -> None:
    try:
        set_parent_death_signal(signal.SIGKILL)
    except OSError:  # not Linux
        return
    if os.getppid() == 1:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """Run one task until killed."""
    p = argparse.ArgumentParser(prog="streamrover-tf-server", description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, choices=["ps", "worker"])
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--cluster", default=os.environ.get(CLUSTER), help=f"cluster spec JSON (default: ${CLUSTER})")
    args = p.parse_args(argv)
    if not args.cluster:
        raise ClusterConfigError(f"no cluster spec: pass --cluster or set {CLUSTER}")
    spec = ClusterSpec.from_json(args.cluster)
    tasks = spec.ps if args.job == "ps" else spec.workers
    if not 0 <= args.index < len(tasks):
        raise ClusterConfigError(f"--index {args.index} is outside the {len(tasks)} {args.job} tasks")
    _die_with_parent()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(spec.as_tf()), job_name=args.job, task_index=args.index, protocol="grpc", start=True
    )
    print("READY", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the launcher stops reading after READY: nothing may block on a full pipe
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
