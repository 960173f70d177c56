"""Real processes for tests and demos: a job master you can SIGKILL and restart on the same port."""

from __future__ import annotations

import os
import secrets
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


class MasterProcess:
    """``streamrover master`` in a subprocess, restartable on the same state dir and port."""

    def __init__(
        self,
        state_dir: str | Path,
        token: str | None = None,
        lease_ttl: float = 2.0,
        log_path: str | Path | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.extra_args = list(extra_args or [])  # more `streamrover master` flags (--tls-cert ...)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token = token or secrets.token_hex(16)
        self.lease_ttl = lease_ttl
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(log_path) if log_path else self.state_dir / "master.log"
        self.starts = 0

    @property
    def address(self) -> str:
        """HOST:PORT of the master (its port once started)."""
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """The URL of its HTTP endpoint (``/metrics``, the dashboard), as the running master wrote it."""
        return (self.state_dir / "dashboard.url").read_text().strip()

    def start(self, timeout: float = 30.0) -> None:
        """Start the master process; returns once it listens (``TimeoutError`` after ``timeout`` seconds)."""
        cmd = [
            sys.executable,
            "-m",
            "streamrover.cli",
            "master",
            "--state-dir",
            str(self.state_dir),
            "--port",
            str(self.port),
            f"--token={self.token}",  # one '=' form: a token starting with '-' is not taken for a flag
            "--lease-ttl",
            str(self.lease_ttl),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=python_env())
        log.close()
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:  # the master prints its address once it listens
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.kill()
                raise TimeoutError(f"master did not listen within {timeout}s: {self.log_tail()}")
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            self.proc.wait()
            raise RuntimeError(f"master failed to start ({self.proc.returncode}): {line} {self.log_tail()}")
        self.port = int(line.split("listening on ", 1)[1].split(";", 1)[0].rsplit(":", 1)[1])
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL the master (nothing is flushed or closed) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        """Kill the master, then start it again on the same state dir and port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Terminate the master (SIGTERM), killing it after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the master's log ('' if unreadable)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> MasterProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def python_env() -> dict[str, str]:
    """The environment for child Python processes (unbuffered output)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_ledger_worker(
    master: MasterProcess,
    dataset: str,
    ledger: str | Path,
    *,
    name: str | None = None,
    batch_size: int = 4096,
    extra: list[str] | None = None,
    stdout: Any = subprocess.PIPE,
) -> subprocess.Popen[bytes]:
    """A ``streamrover.testing.ledger_worker`` process consuming ``dataset`` into ``ledger``."""
    cmd = [
        sys.executable, "-m", "streamrover.testing.ledger_worker", "--master", master.address,
        "--token", master.token, "--dataset", dataset, "--ledger", str(ledger), "--batch-size", str(batch_size),
    ]  # fmt: skip
    if name:
        cmd += ["--name", name]
    cmd += extra or []
    return subprocess.Popen(cmd, env=python_env(), stdout=stdout, stderr=subprocess.STDOUT)
