"""TensorFlow parameter-server training on leased shards, exactly once (``streamrover tf-ps-run``).

The contract (roles, cluster spec, the exactly-once design) is in
:mod:`streamrover.trainers.tensorflow.api`; the chief's loop is :class:`PSTrainer`, the launcher
:mod:`~streamrover.trainers.tensorflow.launcher`. Importing this package does not import
TensorFlow: :class:`PSTrainer`, :class:`SGD`, :class:`Adagrad` and the state helpers load it
when first used.
"""

from __future__ import annotations

from typing import Any

from streamrover.trainers.tensorflow.api import (
    EXIT_RESTART,
    ClusterConfigError,
    ClusterSpec,
    ParameterServerLostError,
    PSTrainingError,
    TrainerEnv,
)
from streamrover.trainers.tensorflow.launcher import LaunchConfig, PSJob

_LAZY = {
    "PSTrainer": "streamrover.trainers.tensorflow.trainer",
    "FitResult": "streamrover.trainers.tensorflow.trainer",
    "default_partitioner": "streamrover.trainers.tensorflow.trainer",
    "SGD": "streamrover.trainers.tensorflow.optim",
    "Adagrad": "streamrover.trainers.tensorflow.optim",
    "variables_state": "streamrover.trainers.tensorflow.state",
    "load_variables_state": "streamrover.trainers.tensorflow.state",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EXIT_RESTART",
    "SGD",
    "Adagrad",
    "ClusterConfigError",
    "ClusterSpec",
    "FitResult",
    "LaunchConfig",
    "PSJob",
    "PSTrainer",
    "PSTrainingError",
    "ParameterServerLostError",
    "TrainerEnv",
    "default_partitioner",
    "load_variables_state",
    "variables_state",
]
