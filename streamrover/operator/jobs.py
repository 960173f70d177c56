"""Where jobs live on the machine that runs ``streamrover run``: one directory per job.

``$STREAMROVER_HOME`` (default ``$XDG_STATE_HOME/streamrover``, i.e. ``~/.local/state/streamrover``)
holds ``jobs/<name>/`` with the spec as run (``job.yaml``), the controller's pid, the
status document the controller rewrites every tick (``status.json``), requests the CLI
leaves for the controller (``requests/scale.json``), logs, and by default the master's
journal and the checkpoints. ``jobs list``, ``status``, ``stop`` and ``scale`` read and
write only here, so they work the same whatever platform runs the nodes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrover.operator.api import PlatformError


class JobNotFoundError(PlatformError, LookupError):
    """No job of that name under this home."""


def home() -> Path:
    """The jobs home (see the module docstring)."""
    if os.environ.get("STREAMROVER_HOME"):
        return Path(os.environ["STREAMROVER_HOME"])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "streamrover"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass(frozen=True)
class JobDir:
    """One job's directory."""

    path: Path

    @property
    def name(self) -> str:
        """The job's name."""
        return self.path.name

    @property
    def status_path(self) -> Path:
        """Where the controller writes the job's status document."""
        return self.path / "status.json"

    @property
    def pid_path(self) -> Path:
        """Where the job's controller writes its pid."""
        return self.path / "controller.pid"

    @property
    def requests(self) -> Path:
        """The directory of requests to the controller (scale)."""
        return self.path / "requests"

    def controller_pid(self) -> int | None:
        """The pid of this job's live controller, or None."""
        try:
            pid = int(self.pid_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            return None  # a zombie: exited, not yet reaped by whoever started it
        return pid

    def status(self) -> dict[str, Any]:
        """The last status document (phase ``unknown`` if the controller never wrote one)."""
        try:
            doc: dict[str, Any] = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            doc = {"job": self.name, "phase": "unknown", "nodes": [], "events": []}
        running = self.controller_pid() is not None
        doc["controller"] = "running" if running else "exited"
        if not running and doc.get("phase") in ("starting", "running"):
            doc["phase"], doc["reason"] = "lost", "the controller exited without a final status (killed?)"
        return doc

    def write_status(self, doc: dict[str, Any]) -> None:
        """Write the job's status document ``doc`` (atomically)."""
        write_atomic(self.status_path, json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")

    def request_scale(self, nodes: int) -> None:
        """Ask the controller to scale the job to ``nodes`` nodes."""
        self.requests.mkdir(exist_ok=True)
        write_atomic(self.requests / "scale.json", json.dumps({"nodes": nodes, "at": time.time()}))

    def take_scale_request(self) -> int | None:
        """The nodes a pending scale request asks for (the request is consumed), or None."""
        path = self.requests / "scale.json"
        try:
            nodes = int(json.loads(path.read_text())["nodes"])
        except (OSError, ValueError, KeyError):
            return None
        path.unlink(missing_ok=True)
        return nodes

    def request_stop(self) -> bool:
        """SIGTERM the controller (it stops the nodes and the master); False if it is not running."""
        pid = self.controller_pid()
        if pid is None:
            return False
        self.requests.mkdir(exist_ok=True)
        write_atomic(self.requests / "stop", str(time.time()))
        os.kill(pid, signal.SIGTERM)
        return True


def job_dir(name: str, root: Path | None = None, create: bool = False) -> JobDir:
    """The directory of job ``name`` (made when ``create``); :class:`JobNotFoundError` naming the known jobs
    otherwise.
    """
    path = (root or home()) / "jobs" / name
    if create:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.is_dir():
        known = ", ".join(j.name for j in list_jobs(root)) or "none"
        raise JobNotFoundError(f"no job {name!r} under {(root or home())} (jobs: {known})")
    return JobDir(path)


def list_jobs(root: Path | None = None) -> list[JobDir]:
    """Every job's directory, by name."""
    base = (root or home()) / "jobs"
    return [JobDir(p) for p in sorted(base.iterdir()) if p.is_dir()] if base.is_dir() else []
