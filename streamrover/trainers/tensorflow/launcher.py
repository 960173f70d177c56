"""``streamrover tf-ps-run``: start and supervise a TF parameter-server job (chief, parameter servers, workers).

    streamrover tf-ps-run --ps 2 --workers 3 --shard-service HOST:PORT --token T --ckpt-dir DIR train.py ARGS...

The launcher picks a free port on 127.0.0.1 for every task, builds the cluster spec (the user
never writes one), starts the servers (``python -m streamrover.trainers.tensorflow.server``) and
then the chief (``python train.py ARGS``, settings in ``STREAMROVER_*`` variables, see
:class:`~streamrover.trainers.tensorflow.api.TrainerEnv`), and supervises them:

* a dead worker is restarted on its port (the coordinator re-runs its closures; the chief
  rolls back to its last checkpoint);
* a dead parameter server is restarted on its port, and the chief is restarted (SIGKILL) so it
  restores the lost variables from the newest checkpoint;
* a chief that exits non-zero (or is killed) is restarted; one that exits 0 ends the job;
* ``SIGUSR1`` adds a worker, ``SIGUSR2`` removes the newest one: the chief is stopped gracefully
  (SIGTERM: it drains and checkpoints) and restarted with the new cluster spec; a leaving worker
  is stopped once the chief is gone. ``SIGTERM``/``SIGINT`` stop the job the same graceful way.

``--status-file`` gets a JSON document of the task pids and the cluster after every change.
Nothing here imports TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from streamrover.shard_service.api import InvalidArgumentError
from streamrover.shard_service.client.tls import add_tls_args, export_tls_args
from streamrover.tokens import resolve_token
from streamrover.trainers.standby import StandbyPool
from streamrover.trainers.tensorflow.api import CLUSTER, ClusterConfigError, ClusterSpec, TrainerEnv

SERVER_MODULE = "streamrover.trainers.tensorflow.server"
TF_WARM_MODULES = ("numpy", "pyarrow", "tensorflow", "streamrover.trainers.tensorflow.trainer")


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} tf-ps-run: {message}", flush=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchConfig:
    """What one ``tf-ps-run`` starts."""

    script: str
    script_args: list[str]
    num_ps: int
    num_workers: int
    master: str
    token: str
    ckpt_dir: str
    ckpt_job: str | None = None
    log_dir: str | None = None
    status_file: str | None = None
    events: str | None = None
    host: str = "127.0.0.1"
    max_restarts: int = 100
    ready_timeout: float = 600.0  # a server imports TensorFlow first: minutes on a loaded 2-core machine
    standby: int = 2  # warm interpreters (TensorFlow imported) for restarted tasks; 0: always start fresh
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_ps < 1:
            raise ClusterConfigError(f"--ps must be >= 1, got {self.num_ps}")
        if self.num_workers < 1:
            raise ClusterConfigError(f"--workers must be >= 1, got {self.num_workers}")
        if not Path(self.script).is_file():
            raise ClusterConfigError(f"training script {self.script!r} does not exist")


class PSJob:
    """The supervised processes of one job; :meth:`run` returns the job's exit code."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tf-ps-run-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ps_addrs = [f"{cfg.host}:{free_port(cfg.host)}" for _ in range(cfg.num_ps)]
        self.worker_addrs = [f"{cfg.host}:{free_port(cfg.host)}" for _ in range(cfg.num_workers)]
        self.chief_addr = f"{cfg.host}:{free_port(cfg.host)}"
        self.ps: list[subprocess.Popen[bytes] | None] = [None] * cfg.num_ps
        self.workers: dict[str, subprocess.Popen[bytes]] = {}  # by address: a leaving worker keeps its entry
        self.chief: subprocess.Popen[bytes] | None = None
        self.chief_starts = 0
        self.restarts = {"ps": 0, "worker": 0, "chief": 0}
        self._events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()  # put() is safe in signal handlers
        self._chief_restart: str | None = None  # why the current chief is being stopped
        self._leaving: list[str] = []
        self._joining: set[str] = set()
        self._booting: dict[tuple[str, Any], subprocess.Popen[bytes]] = {}
        self._chief_due = False  # a chief is to start once the parameter servers listen
        self._ready_pipes: dict[int, IO[bytes]] = {}
        self._standby_ready = 0  # warm standbys, as last written to the status file
        self._pool: StandbyPool | None = None
        if cfg.standby > 0:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # what the standbys import TensorFlow with
            self._pool = StandbyPool(cfg.standby, flags=(), warm=TF_WARM_MODULES, refill_delay=5.0)
        self._stopping = False

    # -- processes ------------------------------------------------------------------------
    def spec(self) -> ClusterSpec:
        """The job's cluster: chief, parameter servers and workers."""
        return ClusterSpec(self.chief_addr, list(self.ps_addrs), list(self.worker_addrs))

    def _log(self, name: str) -> IO[bytes]:
        return open(self.log_dir / f"{name}.log", "ab")

    def _watch(self, kind: str, key: Any, proc: subprocess.Popen[bytes]) -> None:
        def wait() -> None:
            proc.wait()
            self._events.put(("exit", kind, key, proc))

        threading.Thread(target=wait, name=f"watch-{kind}-{key}", daemon=True).start()

    def _launch(self, cmd: list[str], env: dict[str, str], stdout: IO[bytes], stderr: IO[bytes] | None
                ) -> subprocess.Popen[bytes]:  # fmt: skip
        """Run ``cmd`` in a warm standby interpreter (TensorFlow already imported) if one is ready, else fresh."""
        if self._pool is not None:
            proc = self._pool.start(cmd, env, stdout, stderr if stderr is not None else stdout)
            if proc is not None:
                self._pool.schedule_fill()
                return proc
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr if stderr is not None else stdout)

    def _start_server(self, job: str, index: int, address: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.cfg.env, CLUSTER: self.spec().to_json(), "TF_CPP_MIN_LOG_LEVEL": "2"}
        cmd = [sys.executable, "-m", SERVER_MODULE, "--job", job, "--index", str(index)]
        log = self._log(f"{job}-{address.rsplit(':', 1)[1]}")
        read_fd, write_fd = os.pipe()  # the server says READY on its stdout
        with os.fdopen(write_fd, "wb") as out:
            proc = self._launch(cmd, env, out, log)
        log.close()
        self._ready_pipes[proc.pid] = os.fdopen(read_fd, "rb")
        return proc

    def _await_ready(self, proc: subprocess.Popen[bytes], what: str) -> None:
        pipe = self._ready_pipes.pop(proc.pid)
        with selectors.DefaultSelector() as sel:
            sel.register(pipe, selectors.EVENT_READ)
            line = pipe.readline() if sel.select(self.cfg.ready_timeout) else b""
        pipe.close()
        if b"READY" not in line:
            proc.kill()
            raise RuntimeError(f"{what} did not start (see {self.log_dir})")

    def _start_ps(self, index: int) -> None:
        self._spawn_server("ps", index, self.ps_addrs[index])

    def _start_worker(self, address: str) -> None:
        self._spawn_server("worker", address, address)

    def _spawn_server(self, kind: str, key: Any, address: str) -> None:
        """Start a server without blocking supervision; a "ready" event follows once it listens."""
        index = key if kind == "ps" else self.worker_addrs.index(address)
        proc = self._start_server(kind, index, address)
        self._booting[(kind, key)] = proc
        if kind == "ps":
            self.ps[key] = proc
        else:
            self.workers[address] = proc

        def ready() -> None:
            try:
                self._await_ready(proc, f"{kind} {key} at {address}")
            except RuntimeError as exc:
                _say(str(exc))
            self._events.put(("ready", kind, key, proc))

        threading.Thread(target=ready, name=f"ready-{kind}-{key}", daemon=True).start()

    def _on_ready(self, kind: str, key: Any, proc: subprocess.Popen[bytes]) -> None:
        if self._booting.get((kind, key)) is not proc:
            return
        del self._booting[(kind, key)]
        self._watch(kind, key, proc)  # an exit from now on is a failure to handle (before: see _await_ready)
        if proc.poll() is not None:
            return
        _say(f"{kind} {key} (pid {proc.pid}) is ready")
        if kind == "worker" and key in self._joining:
            self._joining.discard(key)
            self._stop_chief("a worker joins")
        self._maybe_start_chief()

    def _maybe_start_chief(self) -> None:
        """Start the chief that is due once no parameter server is still booting."""
        if self._chief_due and not any(kind == "ps" for kind, _ in self._booting):
            self._chief_due = False
            self._start_chief()

    def _start_chief(self) -> None:
        env_cfg = TrainerEnv(self.spec(), self.cfg.master, self.cfg.token, self.cfg.ckpt_dir,
                             self.cfg.ckpt_job, self.cfg.events)  # fmt: skip
        env = {**os.environ, **self.cfg.env, **env_cfg.to_env(), "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        log = self._log("chief")
        self.chief = self._launch([sys.executable, self.cfg.script, *self.cfg.script_args], env, log, None)
        log.close()
        self.chief_starts += 1
        _say(f"chief start {self.chief_starts} (pid {self.chief.pid}), {len(self.worker_addrs)} workers")
        self._watch("chief", self.chief_starts, self.chief)
        self._write_status()

    def _write_status(self) -> None:
        if not self.cfg.status_file:
            return
        doc = {
            "chief": self.chief.pid if self.chief else None,
            "chief_starts": self.chief_starts,
            "ps": [p.pid if p else None for p in self.ps],
            "workers": [self.workers[a].pid if a in self.workers else None for a in self.worker_addrs],
            "cluster": self.spec().as_tf(),
            "restarts": self.restarts,
            "standby_ready": self._standby_ready,
            "log_dir": str(self.log_dir),
        }
        tmp = f"{self.cfg.status_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.cfg.status_file)

    # -- supervision ----------------------------------------------------------------------
    def start(self) -> None:
        """Start every server (in parallel), wait until they listen, then start the chief."""
        procs = [(self._start_server("ps", i, a), f"ps {i}") for i, a in enumerate(self.ps_addrs)]
        procs += [(self._start_server("worker", i, a), f"worker {i}") for i, a in enumerate(self.worker_addrs)]
        for proc, what in procs:
            self._await_ready(proc, what)
        for i in range(len(self.ps_addrs)):
            self.ps[i] = procs[i][0]
            self._watch("ps", i, procs[i][0])
        for j, address in enumerate(self.worker_addrs):
            self.workers[address] = procs[len(self.ps_addrs) + j][0]
            self._watch("worker", address, self.workers[address])
        self._start_chief()
        if self._pool is not None:
            self._pool.schedule_fill()  # after the first start-up: the imports do not compete with it

    def request(self, what: str) -> None:
        """Ask the supervisor for ``"add_worker"``, ``"remove_worker"`` or ``"stop"`` (thread- and signal-safe)."""
        self._events.put(("request", what))

    def _stop_chief(self, why: str, sig: int = signal.SIGTERM) -> None:
        _say(f"stopping the chief ({signal.Signals(sig).name}): {why}")
        self._chief_restart = why
        if self.chief is not None and self.chief.poll() is None:
            self.chief.send_signal(sig)

    def _on_exit(self, kind: str, key: Any, proc: subprocess.Popen[bytes]) -> int | None:
        _say(f"{kind} {key} (pid {proc.pid}) exited with {proc.returncode}")
        if kind == "chief":
            if proc is not self.chief:
                return None
            why, self._chief_restart = self._chief_restart, None
            for address in self._leaving:  # the chief drained their steps
                self.workers.pop(address).terminate()
            self._leaving.clear()
            if why == "stop" or (why is None and proc.returncode == 0):
                return 0 if why == "stop" else proc.returncode
            if why is None:
                self.restarts["chief"] += 1
                if self.restarts["chief"] > self.cfg.max_restarts:
                    return proc.returncode or 1
            self._chief_due = True
            self._maybe_start_chief()
            return None
        if kind == "ps" and self.ps[key] is proc:
            self.restarts["ps"] += 1
            self._start_ps(key)
            self._stop_chief("a parameter server was lost", signal.SIGKILL)  # its variables are gone: restore
        elif kind == "worker" and self.workers.get(key) is proc and key in self.worker_addrs:
            self.restarts["worker"] += 1
            self._start_worker(key)
        self._write_status()
        return None

    def _on_request(self, what: str) -> None:
        _say(f"request: {what}")
        if what == "add_worker":
            address = f"{self.cfg.host}:{free_port(self.cfg.host)}"
            self.worker_addrs.append(address)
            self._joining.add(address)
            self._start_worker(address)  # the chief restarts with it once it listens
        elif what == "remove_worker":
            if len(self.worker_addrs) <= 1:
                return
            self._leaving.append(self.worker_addrs.pop())
            self._stop_chief("a worker leaves")
        elif what == "stop":
            self._stop_chief("stop")
        self._write_status()

    def run(self) -> int:
        """Supervise until the chief finishes (0) or gives up; stop every process; return the exit code."""
        try:
            while True:
                try:
                    event = self._events.get(timeout=1.0)
                except queue.Empty:  # a quiet second: the status file shows how many standbys are warm
                    ready = self._pool.ready() if self._pool is not None else 0
                    if ready != self._standby_ready:
                        self._standby_ready = ready
                        self._write_status()
                    continue
                if event[0] == "request":
                    self._on_request(event[1])
                    continue
                if event[0] == "ready":
                    self._on_ready(*event[1:])
                    continue
                code = self._on_exit(*event[1:])
                if code is not None:
                    return code
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Kill every process this launcher started (the servers hold nothing to keep)."""
        self._stopping = True
        if self._pool is not None:
            self._pool.close()
        procs = [self.chief, *self.ps, *self.workers.values()]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
        for proc in procs:
            if proc is not None:
                proc.wait()
        self._write_status()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamrover tf-ps-run", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--ps", type=int, default=1, help="parameter servers")
    p.add_argument("--workers", type=int, default=1, help="workers (SIGUSR1 adds one, SIGUSR2 removes one)")
    p.add_argument("--shard-service", default=os.environ.get("STREAMROVER_MASTER"), help="HOST:PORT of the master")
    p.add_argument("--token", default=os.environ.get("STREAMROVER_TOKEN", ""), help="the master's token")
    p.add_argument("--token-file", default=None, help="read the master's token from this file (e.g. STATE_DIR/token)")
    add_tls_args(p)
    p.add_argument("--ckpt-dir", required=True, help="checkpoint root (a directory or fsspec URL)")
    p.add_argument("--ckpt-job", default=None, help="checkpoint namespace (jobs sharing a root on one node)")
    p.add_argument("--log-dir", default=None, help="task logs (default: a new temporary directory)")
    p.add_argument("--status-file", default=None, help="write task pids and the cluster here (JSON)")
    p.add_argument("--events", default=None, help="the chief appends restores/rollbacks/checkpoints here (JSONL)")
    p.add_argument("--host", default="127.0.0.1", help="interface of every task (default 127.0.0.1 only)")
    p.add_argument("--max-restarts", type=int, default=100, help="chief restarts after failures before giving up")
    p.add_argument("--standby", type=int, default=2, help="warm interpreters for restarted tasks (0: none)")
    p.add_argument("script", help="the training script (the chief)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``streamrover tf-ps-run``."""
    args = _parser().parse_args(argv)
    try:
        args.token = resolve_token(args.token, args.token_file)
        export_tls_args(args)  # the launcher's clients and every task speak TLS to the master
    except (ValueError, InvalidArgumentError) as exc:
        raise SystemExit(f"tf-ps-run: {exc}") from None
    if not args.shard_service:
        raise SystemExit("tf-ps-run: --shard-service HOST:PORT (or $STREAMROVER_MASTER) is required")
    try:
        cfg = LaunchConfig(
            args.script, list(args.script_args), args.ps, args.workers, args.shard_service, args.token,
            args.ckpt_dir, args.ckpt_job, args.log_dir, args.status_file, args.events, args.host, args.max_restarts,
            standby=args.standby,
        )  # fmt: skip
    except ClusterConfigError as exc:
        raise SystemExit(f"tf-ps-run: {exc}") from exc
    job = PSJob(cfg)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        wanted = {int(signal.SIGUSR1): "add_worker", int(signal.SIGUSR2): "remove_worker"}
        job.request(wanted.get(signum, "stop"))

    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    job.start()
    print(f"tf-ps-run: cluster {job.spec().to_json()}; logs in {job.log_dir}", flush=True)
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
