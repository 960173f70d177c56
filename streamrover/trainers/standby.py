"""Warm standby workers: the agent restarts a worker group in milliseconds instead of seconds.

Most of a restarted torch worker's start-up is not the script's work but the interpreter's:
``import torch`` (~2 s on a small machine) and the first ``DistributedDataParallel``, which
imports ``torch._dynamo`` (~1.5 s more). torchrun pays both on every restart. The
``dlrover-run`` agent keeps ``--standby-workers`` interpreters (default: one per local
worker) that have already imported them and wait. To start a worker the agent hands a
standby exactly what ``subprocess.Popen`` would have been given — the argument vector, the
whole environment, the working directory and the open stdout/stderr log files (passed as
file descriptors over a Unix socket) — and the standby runs the script as ``__main__``, as
``python -u script.py`` would. The worker is the same process torchelastic would have
started: its own session (so the agent's ``killpg`` reaches it), the agent's child (so its
exit code is the agent's to read), no parent-death signal.

Standbys are spawned with the agent's environment and interpreter flags, so whatever
``torch`` reads from the environment at import time is what a fresh worker would have
read. Only ``python [-u] SCRIPT ...`` and ``python [-u] -m MODULE ...`` commands (what
torchrun builds) are served; anything else (``--no-python``, a NUMA wrapper, another
interpreter) starts a fresh process as before. A pool refills itself ``refill_delay``
seconds after handing standbys out, so their imports do not compete with the restarting
workers for CPU.

A standby runs ``python -u -c "import streamrover.trainers.standby as s; s.main()" FD ...``;
FD is its socket to the agent.

A standby can warm the standbys of the command it will run (``children``): a standby *agent* (the
local platform keeps them for a scale-out) spawns its workers' standbys while it waits, so the
agent's worker pool, once the agent runs, adopts them warm instead of spawning fresh interpreters
that import torch while the new group waits for them in ``init_process_group``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from streamrover._libc import set_parent_death_signal
from streamrover.trainers import hugepages, storewait

log = logging.getLogger(__name__)

# What a torch DDP worker imports anyway; each is imported only if installed.
WARM_MODULES = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # imported by DistributedDataParallel's constructor: ~1.5 s on its own
    "torch.utils.data",
    "pyarrow",
    "streamrover.trainers.torch",
)
_MAX_MESSAGE = 4 << 20  # what a standby accepts
_MAX_SEND = 100_000  # what the pool sends (a Unix datagram must fit the socket buffer); larger: a fresh process
_READY = b"ready"


def _set_parent_death_signal(sig: int) -> None:
    try:
        set_parent_death_signal(sig)
    except OSError:  # not Linux: an orphaned standby exits when its socket closes
        pass


class _Standby:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.warm = False

    def poll_warm(self) -> bool:
        """True once the standby has said its imports are done."""
        if not self.warm:
            try:
                self.warm = self.sock.recv(16, socket.MSG_DONTWAIT) == _READY
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return False
        return self.warm


# standbys this process spawned while it was itself a standby, for the pool its command will create
_spares: list[tuple[tuple[Any, ...], _Standby]] = []
_spares_lock = threading.Lock()


def _adopt(key: tuple[Any, ...]) -> _Standby | None:
    """A live spare spawned for a pool of ``key`` (interpreter, flags, warm modules), or None."""
    with _spares_lock:
        for i, (k, standby) in enumerate(_spares):
            if k == key and standby.proc.poll() is None:
                del _spares[i]
                return standby
    return None


class StandbyPool:
    """Warm interpreters for one worker command (``interpreter`` and its ``flags``, e.g. ``-u``)."""

    def __init__(
        self,
        size: int,
        *,
        interpreter: str = sys.executable,
        flags: tuple[str, ...] = ("-u",),
        refill_delay: float = 3.0,
        warm: tuple[str, ...] = WARM_MODULES,
        env: dict[str, str] | None = None,
        children: int = 0,
    ) -> None:
        self.size = max(size, 0)
        self.env = env  # the standbys' environment (None: ours)
        self.children = max(children, 0)  # standbys each standby warms for its command's own pool (module doc)
        self.warm = tuple(warm)
        self.interpreter = interpreter
        self.flags = tuple(flags)
        self.refill_delay = refill_delay
        self.served = 0
        self._standbys: list[_Standby] = []
        self._started: list[_Standby] = []  # handed work; their sockets close once they exit
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._closed = False
        self._fill_at: float | None = None
        self._filler: threading.Thread | None = None

    # -- the pool --------------------------------------------------------------------------
    def fill(self) -> None:
        """Spawn standbys until the pool holds ``size`` live ones."""
        with self._lock:
            if self._closed:
                return
            self._standbys = [s for s in self._standbys if s.proc.poll() is None or self._discard(s)]
            self._started = [s for s in self._started if s.proc.poll() is None or self._discard(s)]
            while len(self._standbys) < self.size:
                # our environment (env None): a spare our own standby spawned before it ran us has it too
                spare = _adopt(self._key()) if self.env is None else None
                self._standbys.append(spare or self._spawn())

    def _key(self) -> tuple[Any, ...]:
        return self.interpreter, self.flags, self.warm

    def ready(self) -> int:
        """How many standbys are alive and warm."""
        with self._lock:
            return sum(1 for s in self._standbys if s.proc.poll() is None and s.poll_warm())

    def schedule_fill(self, delay: float | None = None) -> None:
        """Fill the pool after ``delay`` seconds (default ``refill_delay``), off the caller's thread."""
        with self._cond:
            if self._closed or self.size == 0:
                return
            self._fill_at = time.monotonic() + (self.refill_delay if delay is None else delay)
            if self._filler is None:
                # One long-lived thread spawns the standbys: a child's parent-death signal fires when the
                # *thread* that forked it ends, so a short-lived timer thread would take its standbys with it.
                self._filler = threading.Thread(target=self._fill_loop, name="standby-fill", daemon=True)
                self._filler.start()
            self._cond.notify()

    def _fill_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._fill_at is None or time.monotonic() < self._fill_at):
                    self._cond.wait(None if self._fill_at is None else self._fill_at - time.monotonic())
                if self._closed:
                    return
                self._fill_at = None
            self.fill()

    def _spawn(self) -> _Standby:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                # -c, not -m: a package that imports this module must not be half-run as __main__
                [
                    self.interpreter,
                    *self.flags,
                    "-c",
                    f"import {__name__} as s; s.main()",
                    str(child.fileno()),
                    ",".join(self.warm),
                    str(os.getpid()),  # the standby exits if its agent died before it armed its death signal
                    str(self.children),
                ],
                pass_fds=(child.fileno(),),
                env=self.env,
                start_new_session=True,  # as torchelastic's SubprocessHandler: the agent kills the group
            )
        finally:
            child.close()
        return _Standby(proc, parent)

    @staticmethod
    def _discard(standby: _Standby) -> bool:
        standby.sock.close()
        return False

    def close(self) -> None:
        """Stop every unused standby (they exit when their socket closes; stragglers are killed)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        with self._lock:
            standbys, self._standbys = self._standbys, []
            started, self._started = self._started, []
        for standby in started:  # workers: torchelastic stops them; only our end of their socket goes
            standby.sock.close()
        for standby in standbys:
            standby.sock.close()
        for standby in standbys:
            try:
                standby.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                standby.proc.kill()
                standby.proc.wait()

    # -- serving a start ---------------------------------------------------------------------
    def command(self, args: tuple[str, ...] | list[str]) -> dict[str, Any] | None:
        """What a standby must run for the command ``args``, or None if a standby cannot run it."""
        args = [str(a) for a in args]
        head = [self.interpreter, *self.flags]
        if len(args) < len(head) + 1 or args[: len(head)] != head:
            return None
        rest = args[len(head) :]
        if rest[0] == "-m" and len(rest) >= 2:
            return {"module": rest[1], "argv": rest[2:]}
        if rest[0].startswith("-"):
            return None  # other interpreter options: not what the standby was started with
        return {"path": rest[0], "argv": rest[1:]}

    def start(
        self, args: tuple[str, ...] | list[str], env: dict[str, str], stdout: IO[Any] | None, stderr: IO[Any] | None,
        cwd: str | os.PathLike[str] | None = None, before: Callable[[int], None] | None = None,
    ) -> subprocess.Popen[bytes] | None:  # fmt: skip
        """Run ``args`` (a full command line) in a standby, in ``cwd`` (default: ours); None if no standby can
        (start it as usual). ``before(pid)`` runs before the standby is handed the work (e.g. to move it into a
        cgroup); if it raises, the standby is discarded and the error goes to the caller."""
        command = self.command(args)
        if command is None:
            return None
        # always handed: without a file of its own a Popen child writes to our stdout/stderr as they are now (a spare
        # spawned before this process became what it is, e.g. a standby agent's, still had the standby's)
        message = json.dumps({**command, "env": env, "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                              "stdout": True, "stderr": True}).encode()  # fmt: skip
        if len(message) > _MAX_SEND:
            return None
        fds = [stdout.fileno() if stdout is not None else 1, stderr.fileno() if stderr is not None else 2]
        while True:
            with self._lock:
                if self._closed or not self._standbys:
                    return None
                standby = self._standbys.pop(0)
            try:
                if standby.proc.poll() is not None:
                    raise BrokenPipeError("standby exited")
                if before is not None:
                    try:
                        before(standby.proc.pid)
                    except BaseException:
                        self._kill(standby)
                        raise
                socket.send_fds(standby.sock, [message], fds)
            except OSError as exc:
                log.warning("standby %d unusable (%s); trying another", standby.proc.pid, exc)
                self._kill(standby)
                continue
            # Keep our end open while the worker lives: closing a Unix socket with unread data (the standby's
            # "ready", if we have not read it yet) resets the peer, and a reset beats queued data to its recv.
            with self._lock:
                self._started.append(standby)
            self.served += 1
            return standby.proc

    @staticmethod
    def _kill(standby: _Standby) -> None:
        standby.sock.close()
        if standby.proc.poll() is None:
            standby.proc.kill()
        standby.proc.wait()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Within the block, torchelastic starts binary workers through this pool (falling back to Popen)."""
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

        pool = self
        original = api.get_subprocess_handler

        class StandbyHandler(SubprocessHandler):
            def _popen(self, args: tuple[Any, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
                proc = pool.start(args, env, self._stdout, self._stderr)
                return proc if proc is not None else super()._popen(args, env)

        def get_handler(
            entrypoint: str, args: tuple[Any, ...], env: dict[str, str], stdout: str, stderr: str,
            local_rank_id: int, numa_options: Any = None,
        ) -> SubprocessHandler:  # fmt: skip
            return StandbyHandler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)

        api.get_subprocess_handler = get_handler
        try:
            yield
        finally:
            api.get_subprocess_handler = original


# -- the standby process ------------------------------------------------------------------------
def _warm_up(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an optional module missing (or broken): the script's own import will tell
            print(f"streamrover standby: could not pre-import {name}: {exc}", file=sys.stderr)


def _become(spec: dict[str, Any], fds: list[int]) -> None:
    """Turn this process into the worker ``spec`` describes (as if ``python [-u] ...`` had started it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    it = iter(fds)
    for wanted, target in (("stdout", 1), ("stderr", 2)):
        if spec[wanted]:
            fd = next(it)
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    _set_parent_death_signal(0)  # a worker Popen started would not die with the agent; neither does this one


def _run(spec: dict[str, Any]) -> None:
    import runpy
    import types

    if "module" in spec:
        sys.argv = [spec["module"], *spec["argv"]]  # runpy puts the module's file here, as `python -m` does
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        return
    path = spec["path"]
    sys.argv = [path, *spec["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # `python script.py` puts the script's directory first
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _exit_without_teardown(code: int) -> None:
    """Exit as the interpreter does (wait for the non-daemon threads, run the atexit handlers, flush the standard
    streams) but without its module teardown, which frees every object one by one: 0.6-0.75 s for a torch worker.
    A worker whose collective failed because a peer died raises; the agent stops the group's survivors and
    waits for their exits before it restarts the group, so that teardown was the restart's."""
    wait_for_threads = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first (CPython 3.x)
    if wait_for_threads is not None:
        wait_for_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """A standby's process: import the warm modules, then run the worker the agent hands over its socket."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    _set_parent_death_signal(signal.SIGKILL)  # an unused standby never outlives its agent
    if len(argv) > 2 and os.getppid() != int(argv[2]):  # the agent died before the signal was armed
        sys.exit(0)
    _warm_up([m for m in (argv[1] if len(argv) > 1 else ",".join(WARM_MODULES)).split(",") if m])
    children = int(argv[3]) if len(argv) > 3 else 0
    if children:  # the standbys of the worker pool our command will make (StandbyPool's defaults), warm meanwhile
        spares = StandbyPool(children)
        # spawned from the main thread: their parent-death signal fires when this process ends, not a thread
        with _spares_lock:
            _spares.extend((spares._key(), spares._spawn()) for _ in range(children))
    if not select.select([sock], [], [], 0)[0]:  # no work waiting yet: the worker this becomes will die faster,
        hugepages.collapse()  # and its group restart sooner (hugepages.py); ~0.05-0.5 s
    with contextlib.suppress(OSError):  # the agent may have sent the work (and closed its end) already
        sock.send(_READY)
    try:
        message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
    except OSError:  # the pool closed our socket without sending work (it never closes it after sending)
        sys.exit(0)
    sock.close()
    if not message:  # the pool closed: never used
        sys.exit(0)
    spec = json.loads(message)
    _become(spec, list(fds))
    storewait.install()  # a rank that comes before the group's store server waits for it, not 0.3-1.5 s
    try:
        _run(spec)
    except Exception:  # uncaught: printed, exit code 1, as `python script.py` does (SystemExit passes through)
        sys.excepthook(*sys.exc_info())
        _exit_without_teardown(1)


if __name__ == "__main__":
    main()
