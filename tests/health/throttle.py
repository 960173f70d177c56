"""A CPU quota on processes, for the node health tests: cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``.

``CpuThrottle(fraction)`` makes a child cgroup of the root CPU hierarchy with a quota of ``fraction`` of
one core (``fraction * 100`` ms per 100 ms period); :meth:`add` moves processes into it (their future
children are born inside); :meth:`close` moves them back and removes it. Which hierarchy the machine has
is detected: the v2 unified hierarchy where its ``cgroup.controllers`` lists ``cpu``, else the v1 ``cpu``
controller's mount. Both need root (a test that cannot write either fails saying so).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

PERIOD_US = 100_000


def cpu_hierarchy() -> tuple[Path, int]:
    """(root directory, version) of the CPU controller's hierarchy this machine mounts."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if rest and rest[0] == "cgroup2":
            root = Path(fields[4])
            if "cpu" in (root / "cgroup.controllers").read_text().split():
                return root, 2
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if rest and rest[0] == "cgroup" and "cpu" in rest[2].split(","):
            return Path(fields[4]), 1
    raise RuntimeError("no cgroup CPU controller mounted here (need cgroup v2 with cpu, or the v1 cpu hierarchy)")


class CpuThrottle:
    """Processes limited to ``fraction`` of one core (see the module docstring); ``weight`` instead gives them
    that many times a process's share of the CPU when the machine is busy (v1 ``cpu.shares``, v2 ``cpu.weight``);
    ``parent``: a group of this kind to nest in (a throttled node inside the job's weighted group)."""

    def __init__(self, fraction: float | None, weight: int | None = None, parent: CpuThrottle | None = None) -> None:
        self.root, self.version = cpu_hierarchy()
        self.path = (parent.path if parent else self.root) / f"streamrover-throttle-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        if weight is not None:
            if self.version == 2:
                (self.path / "cpu.weight").write_text(str(min(100 * weight, 10_000)))
            else:
                (self.path / "cpu.shares").write_text(str(1024 * weight))
        if fraction is not None:
            quota = int(fraction * PERIOD_US)
            if self.version == 2:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, *pids: int) -> list[int]:
        """Move ``pids`` in (those that still exist); returns the ones moved."""
        moved = []
        for pid in pids:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
                moved.append(pid)
            except ProcessLookupError:
                continue
        return moved

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def throttled_seconds(self) -> float:
        """How long the group's processes were held back by the quota so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_usec":
                return int(value) / 1e6
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def close(self, timeout: float = 10.0) -> None:
        """Move the processes left back to the root group and remove this one (retried while exiting processes
        still hold it, up to ``timeout`` s)."""
        give_up = time.monotonic() + timeout
        while True:
            for pid in self.pids():
                try:
                    (self.root / "cgroup.procs").write_text(str(pid))
                except OSError:  # gone meanwhile
                    continue
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.1)  # a process in it is still exiting: retry

    def __enter__(self) -> CpuThrottle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    import psutil

    try:
        parent = psutil.Process(pid)
        return [pid, *(c.pid for c in parent.children(recursive=True))]
    except psutil.Error:
        return []


__all__ = ["CpuThrottle", "cpu_hierarchy", "tree"]
