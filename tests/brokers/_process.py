"""Shared plumbing for the broker fixtures: ports, child processes, readiness waits, errors.

A broker is one or more child processes, each started in its own session (process group) with
``PR_SET_PDEATHSIG=SIGKILL``, so that nothing outlives the test run: a clean exit stops them
(``atexit``), a crash of the Python process kills them (the kernel sends SIGKILL when the parent
dies), and ``stop``/``kill`` signal the whole group.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


class BrokerError(RuntimeError):
    """A broker fixture could not do what was asked (start, stop, admin call)."""


class BrokerStartError(BrokerError):
    """A broker did not become ready; the message carries the tail of its log."""


class MissingDependencyError(BrokerError):
    """A binary, jar set or client library the fixture needs is not installed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (held open together while picking, so distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def port_accepting(port: int, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    """True if a TCP connection to host:port is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 40, start: int = 0) -> str:
    """The last ``lines`` lines of a log file from byte offset ``start`` ('' if there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


#: util-linux's setpriv sets the child's parent-death signal itself, so Popen needs no ``preexec_fn``: a
#: ``preexec_fn`` makes CPython fork() instead of vfork(), and a fork runs gRPC's fork handlers in the child,
#: which restart its poller there; Popen's close_fds then closes the poller's epoll fd and the child aborts
#: before its exec (grpc/grpc#43055, grpcio >= 1.81; seen: kube-scheduler "exited with code -6" after "Epoll1Poller
#: ... epoll_wait error: Bad file descriptor" in its log, every k8s test erroring at set-up).
_SETPRIV = shutil.which("setpriv")


def _spawn_argv(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` to start a child that is SIGKILLed when this process dies, and the ``preexec_fn`` it still needs."""
    if _SETPRIV is not None:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv], None
    return argv, _die_with_parent


class ChildProcess:
    """One long-running child process with its output appended to a log file.

    The log file is appended across restarts; ``log_offset`` is where the current run's output
    begins, so readiness checks only look at lines of the current run.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, cwd: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        self.log_offset = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> None:
        if self.running():
            raise BrokerError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(f"===== {self.name} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            argv, preexec = _spawn_argv(self.argv)
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                env=self.env, start_new_session=True, preexec_fn=preexec,
            )
        atexit.register(self._atexit_kill)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines, self.log_offset)

    def log_contains(self, text: str) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return text.encode() in f.read()
        except OSError:
            return False

    def _signal_group(self, sig: int) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the process group, wait up to ``timeout`` s, then SIGKILL."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._append_note(f"did not exit {timeout:.0f}s after SIGTERM; sending SIGKILL")
                self._signal_group(signal.SIGKILL)
                self._proc.wait()
        self._signal_group(signal.SIGKILL)  # stragglers of the group, if any
        self._done()

    def kill(self) -> None:
        """SIGKILL to the process group and reap it."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self._proc.wait()
        self._done()

    def _done(self) -> None:
        atexit.unregister(self._atexit_kill)
        self._proc = None

    def _atexit_kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(10)

    def _append_note(self, note: str) -> None:
        with contextlib.suppress(OSError), open(self.log_path, "ab") as log:
            log.write(f"===== fixture: {self.name} {note}\n".encode())


def wait_until(what: str, condition: Callable[[], bool], *, timeout: float,
               procs: Sequence[ChildProcess], interval: float = 0.1) -> float:
    """Poll ``condition`` until it is true; return the seconds waited.

    A bounded poll: used only where the broker offers no event to wait on (a port, an admin call).
    Fails fast if one of ``procs`` exits, and on timeout; the error carries each log's tail.
    """
    start = time.monotonic()
    deadline = start + timeout
    while True:
        for p in procs:
            if not p.running():
                raise BrokerStartError(
                    f"{p.name} exited with code {p.returncode()} while waiting for {what}.\n"
                    f"--- tail of {p.log_path} ---\n{p.log_tail()}"
                )
        try:
            if condition():
                return time.monotonic() - start
        except Exception as exc:  # a readiness probe may fail in any way until the broker is up
            last = f"{type(exc).__name__}: {exc}"
        else:
            last = "condition false"
        if time.monotonic() >= deadline:
            logs = "\n".join(f"--- tail of {p.log_path} ---\n{p.log_tail()}" for p in procs)
            raise BrokerStartError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last}).\n{logs}")
        time.sleep(interval)


class Lifecycle:
    """``restart`` and ``cleanup`` of a broker, from its ``start``, ``stop`` and ``kill``."""

    workdir: Path

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def restart(self, *, hard: bool = False) -> None:
        """Stop (or kill, if ``hard``) and start again on the same ports and data."""
        if hard:
            self.kill()
        else:
            self.stop()
        self.start()

    def cleanup(self) -> None:
        """Stop and delete the work directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class OneProcessBroker(Lifecycle):
    """A broker that is one child process (``_proc``): it is launched, waited for, stopped and killed alike."""

    _proc: ChildProcess
    startup_timeout: float
    startup_seconds: float | None
    stop_timeout = 10.0

    def is_running(self) -> bool:
        return self._proc.running()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self._proc.log_path

    def rss_bytes(self) -> int:
        return rss_bytes([self.pid])

    def _launch(self, what: str, ready: Callable[[], bool], interval: float = 0.1) -> None:
        """Start ``_proc`` (its argv set) and wait until ``ready``; killed again when it never is."""
        t0 = time.monotonic()
        self._proc.start()
        try:
            wait_until(what, ready, timeout=self.startup_timeout, procs=[self._proc], interval=interval)
        except BrokerStartError:
            self._proc.kill()
            raise
        self.startup_seconds = time.monotonic() - t0

    def stop(self, timeout: float | None = None) -> None:
        """Controlled shutdown (SIGTERM), SIGKILL after ``timeout`` s."""
        self._proc.stop(self.stop_timeout if timeout is None else timeout)

    def kill(self) -> None:
        """SIGKILL: the broker dies without flushing or closing anything."""
        self._proc.kill()


def cache_root() -> Path:
    """``$STREAMROVER_CACHE`` or ``~/.cache/streamrover``: where fetched jars and built helpers live."""
    return Path(os.environ.get("STREAMROVER_CACHE") or Path.home() / ".cache" / "streamrover")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def jars_dir(broker: str, version: str) -> Path:
    """The cached jar directory for ``broker``-``version``, fetching it once if absent.

    Fetching runs ``scripts/fetch-jars.sh <broker>`` (Maven, from the poms in tests/brokers/jars/).
    """
    d = cache_root() / "jars" / f"{broker}-{version}"
    if not (d / ".complete").exists():
        script = repo_root() / "scripts" / "fetch-jars.sh"
        proc = subprocess.run(["bash", str(script), broker], capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not (d / ".complete").exists():
            raise MissingDependencyError(
                f"jars for {broker} {version} are not in {d} and `scripts/fetch-jars.sh {broker}` failed "
                f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
    return d


def rss_bytes(pids: Sequence[int | None]) -> int:
    """Resident memory of the given processes and their children, summed (needs psutil)."""
    import psutil

    total = 0
    for pid in pids:
        if pid is None:
            continue
        try:
            p = psutil.Process(pid)
            total += p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return total
