"""The platform contract: what a platform (local processes, Ray, Kubernetes) does for a job.

A platform only **launches, stops and observes**: the job master and the job's nodes
(one node = one ``dlrover-run`` agent with its workers). It decides nothing: relaunch,
more memory after an OOM, scale-in and scale-out are the supervisor's decisions
(:mod:`streamrover.operator.supervisor`), the same on every platform.

How the backends map onto it:

============  =====================================  ====================================  =========================
              local (``local.py``)                   ray (``ray.py``)                      k8s (``k8s.py``)
============  =====================================  ====================================  =========================
master        a ``streamrover master`` process       an actor                              a pod + service, volume
node          a process group (in a memory cgroup)   an actor in the job's placement group  a pod
memory        cgroup ``memory.max`` / v1 limit       actor memory resource                 the pod's memory limit
OOM seen by   the cgroup's ``oom_kill`` counter      the actor's death cause               ``OOMKilled`` reason
lost node     the agent died of a signal             the actor's node died                 pod deleted / node lost
============  =====================================  ====================================  =========================
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PlatformError(RuntimeError):
    """A platform could not do what it was asked."""


class LaunchError(PlatformError):
    """A master or node could not be started (the message says why and what to check)."""


class UnknownNodeError(PlatformError, KeyError):
    """No node of that id was launched on this platform."""


class PlatformUnavailableError(PlatformError):
    """The platform's engine is not installed or not reachable (``pip install streamrover[ray]``...)."""


class NodeState(enum.Enum):
    """A node as the platform sees it. ``LOST``: killed from outside (signal, node gone), not by its own exit."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # the agent exited 0: training finished
    FAILED = "failed"  # the agent exited non-zero: its worker restarts are spent, or it crashed
    LOST = "lost"  # killed by a signal, its machine or pod gone
    OOM_KILLED = "oom_killed"  # the memory limit was hit: a process of the node was killed by the OOM killer
    STOPPED = "stopped"  # stopped on request (scale-in, job stop)

    @property
    def ended(self) -> bool:
        """Whether the node is done (neither pending nor running)."""
        return self not in (NodeState.PENDING, NodeState.RUNNING)


@dataclass(frozen=True)
class MasterLaunch:
    """What the job master needs: its journal, where to listen, its token."""

    job: str
    state_dir: Path
    token: str
    host: str = "127.0.0.1"
    port: int = 0
    lease_ttl: float = 10.0
    args: tuple[str, ...] = ()  # more `streamrover master` flags (--tls-cert ...)


@dataclass(frozen=True)
class MasterInfo:
    """A running master: the address nodes and clients use."""

    address: str
    pid: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class NodeLaunch:
    """One node: its command (``dlrover-run ...``), environment and resources."""

    job: str
    node_id: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    memory: int | None = None  # bytes; enforced where the platform can
    cpu: float | None = None  # cores
    workdir: Path | None = None  # logs and scratch


@dataclass(frozen=True)
class NodeStatus:
    """A node's state as last observed."""

    node_id: str
    state: NodeState
    exit_code: int | None = None
    oom_kills: int = 0
    memory: int | None = None
    pid: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Resources:
    """What the platform can give a job, and how it enforces memory."""

    cpus: float
    memory: int
    max_nodes: int | None = None  # None: as many as fit
    memory_enforcement: str = "none"  # "cgroup-v2", "cgroup-v1", "watchdog", "pod-limit", "none"
    detail: dict[str, Any] = field(default_factory=dict)


class Platform(ABC):
    """Launches, stops and observes a job's master and nodes. One instance serves one job."""

    name: str = ""

    @abstractmethod
    def launch_master(self, launch: MasterLaunch) -> MasterInfo:
        """Start the job master and return once it listens (a relaunch keeps the address)."""

    @abstractmethod
    def observe_master(self) -> NodeStatus:
        """The master's state (``node_id`` is ``"master"``)."""

    @abstractmethod
    def stop_master(self, grace: float = 10.0) -> None:
        """Stop the master (its journal stays: a later launch resumes it)."""

    @abstractmethod
    def launch_node(self, launch: NodeLaunch) -> NodeStatus:
        """Start one node; raises :class:`LaunchError` if it cannot start at all."""

    @abstractmethod
    def stop_node(self, node_id: str, grace: float = 30.0) -> NodeStatus:
        """Ask the node to leave (SIGTERM to its agent), kill what is left after ``grace`` seconds."""

    @abstractmethod
    def observe(self, node_id: str) -> NodeStatus:
        """The node's current state; :class:`UnknownNodeError` if never launched here."""

    @abstractmethod
    def resources(self) -> Resources:
        """What the platform has for this job."""

    def launcher_args(self) -> list[str]:
        """``dlrover-run`` flags this platform's nodes need (e.g. the address to bind)."""
        return []

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the platform holds for the job (processes are stopped by the caller first)."""
