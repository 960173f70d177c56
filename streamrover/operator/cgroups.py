"""Memory limits for local nodes: a memory cgroup per node (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``).

The kernel's OOM killer then acts inside the node's limit exactly as on a Kubernetes
node, and the cgroup counts its kills (``oom_kill`` in v2 ``memory.events`` or v1
``memory.oom_control``), which is how the supervisor tells an OOM from any other death.

The node's cgroup is made under the cgroup this process runs in. cgroup v2 needs the
memory controller delegated there (``cgroup.subtree_control`` lists ``memory``); where
it is not (a hybrid host whose unified hierarchy has no memory controller, as this
project's machines), the v1 memory hierarchy is used if mounted and writable. Where
neither can be written, :func:`memory_cgroups` returns None and limits are not enforced
by the kernel (the local platform then watches resident memory itself).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CgroupRoot:
    """Where node cgroups are made: ``path`` (a directory), and the hierarchy version (1 or 2)."""

    path: Path
    version: int

    @property
    def enforcement(self) -> str:
        """How memory limits are enforced, for status: ``cgroup-v1`` or ``cgroup-v2``."""
        return f"cgroup-v{self.version}"

    def create(self, name: str, memory: int | None) -> NodeCgroup:
        """A fresh cgroup ``name`` (a leftover of a previous run is emptied first) with the memory limit."""
        cg = NodeCgroup(self.path / name, self.version)
        if cg.path.exists():
            cg.kill_all()
            cg.remove()
        cg.path.mkdir()
        if memory is not None:
            cg.set_memory(memory)
        return cg


@dataclass(frozen=True)
class NodeCgroup:
    """One node's memory cgroup."""

    path: Path
    version: int

    def set_memory(self, nbytes: int) -> None:
        """Limit the group's memory to ``nbytes`` (and, in v2, its swap to none)."""
        if self.version == 2:
            (self.path / "memory.max").write_text(str(nbytes))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(nbytes))

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The processes in the group (none once it is gone)."""
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in this cgroup so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except FileNotFoundError:
            pass
        return 0

    def peak(self) -> int | None:
        """The group's peak memory use in bytes, or None when the kernel does not say."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def kill_all(self) -> None:
        """SIGKILL every process in the cgroup (a v2 ``cgroup.kill`` where the kernel has it)."""
        kill = self.path / "cgroup.kill"
        if self.version == 2 and kill.exists():
            kill.write_text("1")
            return
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue

    def remove(self) -> bool:
        """Remove the cgroup once it is empty (False if processes are still in it)."""
        try:
            self.path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: processes still exiting
            return False


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _mounts() -> dict[str, Path]:
    """"cgroup2" or a v1 controller name -> its mount point, from /proc/self/mountinfo."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, options = rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            out.setdefault("cgroup2", Path(fields[4]))
        elif fstype == "cgroup":
            for opt in options:
                out.setdefault(opt, Path(fields[4]))
    return out


def _writable(directory: Path) -> bool:
    probe = directory / f"streamrover-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def memory_cgroups() -> CgroupRoot | None:
    """Where this process may make memory-limited child cgroups, or None (see the module docstring)."""
    try:
        own, mounts = _own_cgroups(), _mounts()
    except OSError:
        return None
    if "cgroup2" in mounts and "" in own:
        here = mounts["cgroup2"] / own[""].lstrip("/")
        try:
            delegated = "memory" in (here / "cgroup.subtree_control").read_text().split()
        except OSError:
            delegated = False
        if delegated and _writable(here):
            return CgroupRoot(here, 2)
    if "memory" in mounts and "memory" in own:
        here = mounts["memory"] / own["memory"].lstrip("/")
        if (here / "memory.limit_in_bytes").exists() and _writable(here):
            return CgroupRoot(here, 1)
    log.info("no writable memory cgroup here: node memory limits are watched, not enforced by the kernel")
    return None
