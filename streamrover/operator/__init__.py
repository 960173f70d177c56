"""Platforms that run and supervise a job from one spec: ``streamrover run job.yaml [--platform local|ray|k8s]``.

* :mod:`~streamrover.operator.spec`: the job spec (YAML, a typed model, a published JSON schema);
* :mod:`~streamrover.operator.api`: the platform contract (launch, stop, observe) and its errors;
* :mod:`~streamrover.operator.registry`: platforms by name (``local``, ``ray`` imported on first use);
* :mod:`~streamrover.operator.local`: the ``local`` platform (processes, memory cgroups);
* :mod:`~streamrover.operator.supervisor`: platform-neutral supervision (relaunch, OOM, scale, fail);
* :mod:`~streamrover.operator.controller`: what ``streamrover run`` runs; :mod:`~streamrover.operator.jobs`:
  the jobs directory that ``jobs list``, ``status``, ``stop`` and ``scale`` use.

Importing this package imports nothing heavy (the spec's pydantic only when the spec module is used).
"""

from streamrover.operator.api import (
    LaunchError,
    MasterInfo,
    MasterLaunch,
    NodeLaunch,
    NodeState,
    NodeStatus,
    Platform,
    PlatformError,
    PlatformUnavailableError,
    Resources,
    UnknownNodeError,
)
from streamrover.operator.registry import create_platform, register_platform

__all__ = [
    "LaunchError",
    "MasterInfo",
    "MasterLaunch",
    "NodeLaunch",
    "NodeState",
    "NodeStatus",
    "Platform",
    "PlatformError",
    "PlatformUnavailableError",
    "Resources",
    "UnknownNodeError",
    "create_platform",
    "register_platform",
]
