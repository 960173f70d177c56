"""The ``local`` platform: the job master and its nodes as processes on this machine (no cluster needed).

* The master is ``streamrover master`` in a subprocess; a relaunch reuses its port, so
  nodes and clients keep their address (its journal makes the restart lossless).
* A node is a process group (its own session) whose leader is the ``dlrover-run`` agent.
  With a memory limit it runs in its own memory cgroup (:mod:`~streamrover.operator.cgroups`):
  the process joins it before it execs, so everything the agent starts is inside. The
  kernel's OOM killer enforces the limit and the cgroup's ``oom_kill`` count tells the
  supervisor it happened. Where no memory cgroup can be made, a watchdog of resident
  memory (the node's processes summed) SIGKILLs the largest process over the limit and
  counts that as an OOM kill: the same outcome, later and coarser than the kernel's.
"""

from __future__ import annotations

import logging
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from streamrover.operator import die_with_parent
from streamrover.operator.api import (
    LaunchError,
    MasterInfo,
    MasterLaunch,
    NodeLaunch,
    NodeState,
    NodeStatus,
    Platform,
    Resources,
    UnknownNodeError,
)
from streamrover.operator.cgroups import CgroupRoot, NodeCgroup, memory_cgroups
from streamrover.trainers.standby import StandbyPool

log = logging.getLogger(__name__)
MEMORY_ENV = "STREAMROVER_NODE_MEMORY"  # the node's memory limit in bytes, for scripts that size themselves
# what a standby agent imports (``dlrover-run``: torch and torchelastic); each only if installed
AGENT_MODULES = ("torch", "torch.distributed.run", "streamrover.trainers.torch.agent",
                 "streamrover.trainers.torch.rendezvous")


@dataclass
class _Node:
    launch: NodeLaunch
    proc: subprocess.Popen[bytes]
    cgroup: NodeCgroup | None
    watchdog_kills: int = 0
    stopped: bool = False


class LocalPlatform(Platform):
    """Processes on this machine. ``cgroups=False`` forces the resident-memory watchdog (tests, no root)."""

    name = "local"

    def __init__(self, workdir: str | Path, cgroups: bool = True, watch_interval: float = 0.25,
                 die_with_parent: bool = False, reap: bool = True,
                 standby_agents: int = 0, standby_workers: int = 0) -> None:  # fmt: skip
        self.workdir = Path(workdir)
        # warm agents (torch imported) a scale-out or relaunch starts its nodes in; not under ray. Each
        # warms ``standby_workers`` standbys for its agent's workers meanwhile: a scale-out's new workers started
        # in standbys still importing torch, and the whole new group waited for them in init_process_group
        self._standby: StandbyPool | None = None
        if standby_agents > 0 and not die_with_parent:
            self._standby = StandbyPool(standby_agents, flags=(), warm=AGENT_MODULES, env=_env({}),
                                        children=standby_workers)  # fmt: skip
        # the ray platform: each process started through operator/die_with_parent.py, so it dies with the actor
        self._die_with_parent = die_with_parent
        self.workdir.mkdir(parents=True, exist_ok=True)
        # what this platform started, so a successor on the same workdir can end what a killed controller left
        self._pids: Path | None = self.workdir / "pids" if reap else None
        self.reaped = _reap(self._pids) if self._pids else []
        self._cgroups: CgroupRoot | None = memory_cgroups() if cgroups else None
        self._nodes: dict[str, _Node] = {}
        self._master: subprocess.Popen[bytes] | None = None
        self._master_launch: MasterLaunch | None = None
        self._master_stopped = False
        self._port = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watch_interval = watch_interval
        self._watchdog: threading.Thread | None = None

    # -- the master -------------------------------------------------------------------------
    def launch_master(self, launch: MasterLaunch, timeout: float = 60.0) -> MasterInfo:
        port = self._port or launch.port
        cmd = [
            sys.executable, "-m", "streamrover.cli", "master", "--state-dir", str(launch.state_dir),
            "--host", launch.host, "--port", str(port), "--lease-ttl", str(launch.lease_ttl), *launch.args,
        ]  # fmt: skip  (the token goes in the environment: not in ps, and a token may start with "-")
        launch.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "master.log", "ab") as logf:
            env = _env({"STREAMROVER_TOKEN": launch.token})
            proc = subprocess.Popen(self._argv(cmd), stdout=subprocess.PIPE, stderr=logf, env=env,
                                    start_new_session=True)  # fmt: skip
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:  # the master prints its address once it listens
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        line = proc.stdout.readline().decode() if ready else ""
        if "listening on" not in line:
            proc.kill()
            proc.wait()
            tail = _tail(self.workdir / "master.log")
            raise LaunchError(f"the job master did not start (exit {proc.returncode}): {line.strip()}\n{tail}")
        # The master prints more after its address (its dashboard's URL...): keep its stdout open and drained into
        # its log. Closing it made a later print die of BrokenPipeError, and with it the master (a race: seen
        # under load when the dashboard line came after the close).
        threading.Thread(target=_drain, args=(proc.stdout, self.workdir / "master.log"), name="master-stdout",
                         daemon=True).start()  # fmt: skip
        address = line.split("listening on ", 1)[1].split(";", 1)[0].strip()
        self._port = int(address.rsplit(":", 1)[1])
        self._master, self._master_launch, self._master_stopped = proc, launch, False
        if self._pids:
            _record(self._pids, "master", proc.pid)
        return MasterInfo(address=address, pid=proc.pid)

    def observe_master(self) -> NodeStatus:
        if self._master is None:
            return NodeStatus("master", NodeState.PENDING)
        return _status("master", self._master, oom_kills=0, stopped=self._master_stopped)

    def stop_master(self, grace: float = 10.0) -> None:
        self._master_stopped = True
        if self._master is not None and self._master.poll() is None:
            self._master.terminate()
            try:
                self._master.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._master.kill()
                self._master.wait()
        if self._pids:
            (self._pids / "master").unlink(missing_ok=True)

    # -- nodes ----------------------------------------------------------------------------
    def launch_node(self, launch: NodeLaunch) -> NodeStatus:
        with self._lock:
            if launch.node_id in self._nodes and self._nodes[launch.node_id].proc.poll() is None:
                raise LaunchError(f"node {launch.node_id!r} is already running")
        workdir = launch.workdir or self.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        cgroup = None
        command = list(launch.command)
        if self._cgroups is not None and launch.memory is not None:
            cgroup = self._cgroups.create(f"streamrover.{launch.job}.{launch.node_id}", launch.memory)
            # the shell joins the cgroup, then execs the agent: nothing of the node starts outside it
            join = f"echo $$ > {shlex.quote(str(cgroup.path / 'cgroup.procs'))} && exec \"$@\""
            command = ["/bin/sh", "-c", join, "sh", *command]
        env = dict(launch.env)
        if launch.memory is not None:
            env[MEMORY_ENV] = str(launch.memory)
        try:
            with open(workdir / f"node-{launch.node_id}.log", "ab") as logf:
                proc = self._start_warm(launch, env, logf, workdir)
                if proc is None:
                    proc = subprocess.Popen(self._argv(command), env=_env(env), stdout=logf, stderr=subprocess.STDOUT,
                                            cwd=workdir, start_new_session=True)  # fmt: skip
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            raise LaunchError(f"node {launch.node_id}: cannot run {launch.command[0]!r}: {exc}") from exc
        with self._lock:
            self._nodes[launch.node_id] = _Node(launch, proc, cgroup)
        if self._pids:
            _record(self._pids, f"node-{launch.node_id}", proc.pid, cgroup.path if cgroup else None)
        if cgroup is None and launch.memory is not None:
            self._start_watchdog()
        return self.observe(launch.node_id)

    def _argv(self, command: list[str]) -> list[str]:
        return die_with_parent.wrap(command) if self._die_with_parent else command

    def _start_warm(self, launch: NodeLaunch, env: dict[str, str], logf: IO[bytes],
                    workdir: Path) -> subprocess.Popen[bytes] | None:  # fmt: skip
        """The node's agent in a warm standby (its imports done), or None: start it afresh.

        Only a node without a memory limit (a standby's memory so far was charged outside the node's cgroup),
        whose extra environment is streamrover's own (torch read its environment when the standby imported it).
        """
        if self._standby is None or launch.memory is not None or any(not k.startswith("STREAMROVER_") for k in env):
            return None
        proc = self._standby.start(launch.command, _env(env), logf, logf, cwd=workdir)
        self._standby.schedule_fill()  # a spare for the next scale-out or relaunch, once this node has started
        if proc is not None:
            log.info("node %s starts in a warm standby agent (pid %d)", launch.node_id, proc.pid)
        return proc

    def warm_agents(self) -> int:
        """How many standby agents are warm now (their imports done)."""
        return self._standby.ready() if self._standby is not None else 0

    def _node(self, node_id: str) -> _Node:
        with self._lock:
            try:
                return self._nodes[node_id]
            except KeyError:
                raise UnknownNodeError(f"no node {node_id!r} was launched here") from None

    def observe(self, node_id: str) -> NodeStatus:
        node = self._node(node_id)
        kills = node.watchdog_kills + (node.cgroup.oom_kills() if node.cgroup is not None else 0)
        status = _status(node_id, node.proc, kills, node.stopped)
        if status.exit_code is not None:  # the agent is gone: its children (standbys, workers) go with it
            if self._pids:
                (self._pids / f"node-{node_id}").unlink(missing_ok=True)
            if node.cgroup is not None:
                node.cgroup.kill_all()
                node.cgroup.remove()
            else:
                _killpg(node.proc.pid)
        return NodeStatus(status.node_id, status.state, status.exit_code, kills, node.launch.memory, node.proc.pid,
                          status.detail)  # fmt: skip

    def stop_node(self, node_id: str, grace: float = 30.0) -> NodeStatus:
        node = self._node(node_id)
        node.stopped = True
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)  # torchelastic stops its workers and leaves the rendezvous
            try:
                node.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("node %s did not leave within %.0f s: killing it", node_id, grace)
        if node.cgroup is not None:
            node.cgroup.kill_all()
        _killpg(node.proc.pid)
        node.proc.wait()
        return self.observe(node_id)

    def pids(self, node_id: str) -> list[int]:
        """Every process of the node (its cgroup's or its process group's): for tests and ``status``."""
        node = self._node(node_id)
        if node.cgroup is not None:
            return node.cgroup.pids()
        import psutil

        try:
            parent = psutil.Process(node.proc.pid)
            return [parent.pid] + [c.pid for c in parent.children(recursive=True)]
        except psutil.Error:
            return []

    def launcher_args(self) -> list[str]:
        return ["--local-addr", "127.0.0.1"]

    def resources(self) -> Resources:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        enforcement = self._cgroups.enforcement if self._cgroups else "watchdog"
        detail = {"cgroup": str(self._cgroups.path)} if self._cgroups else {}
        return Resources(cpus=float(os.cpu_count() or 1), memory=pages, memory_enforcement=enforcement, detail=detail)

    def close(self) -> None:
        self._closed.set()
        if self._standby is not None:
            self._standby.close()
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
            if node.cgroup is not None:
                node.cgroup.kill_all()
                node.cgroup.remove()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)

    # -- the resident-memory watchdog (no memory cgroup) --------------------------------------
    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="memory-watchdog", daemon=True)
                self._watchdog.start()

    def _watch(self) -> None:
        import psutil

        while not self._closed.wait(self._watch_interval):  # a sampling period, not synchronisation
            with self._lock:
                nodes = [n for n in self._nodes.values() if n.cgroup is None and n.launch.memory is not None]
            for node in nodes:
                if node.proc.poll() is not None:
                    continue
                try:
                    procs = [psutil.Process(node.proc.pid)]
                    procs += procs[0].children(recursive=True)
                    rss = {p: p.memory_info().rss for p in procs}
                except psutil.Error:
                    continue
                if sum(rss.values()) > (node.launch.memory or 0):
                    victim = max(rss, key=lambda p: rss[p])
                    log.warning("node %s over its memory limit (%d > %d bytes): killing pid %d", node.launch.node_id,
                                sum(rss.values()), node.launch.memory, victim.pid)  # fmt: skip
                    node.watchdog_kills += 1
                    try:
                        victim.kill()
                    except psutil.Error:
                        continue


def _status(node_id: str, proc: subprocess.Popen[bytes], oom_kills: int, stopped: bool) -> NodeStatus:
    code = proc.poll()
    if oom_kills:
        state = NodeState.OOM_KILLED
    elif code is None:
        state = NodeState.RUNNING
    elif stopped:
        state = NodeState.STOPPED
    elif code == 0:
        state = NodeState.SUCCEEDED
    elif code < 0:
        state = NodeState.LOST
    else:
        state = NodeState.FAILED
    detail = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else ""
    return NodeStatus(node_id, state, code, oom_kills, pid=proc.pid, detail=detail)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): tells a pid reused from the original."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _record(directory: Path, name: str, pid: int, cgroup: Path | None = None) -> None:
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(f"{pid} {_start_time(pid)} {cgroup or ''}\n")


def _reap(directory: Path) -> list[int]:
    """End what a previous platform on this workdir started and left running (its controller was killed).

    A job master left running on the same journal as a new one, or agents still in the old rendezvous, would
    compete with the new run. Each recorded process group (and its cgroup) is killed if its leader is still the
    process recorded (same start time); returns the pids killed.
    """
    killed = []
    for entry in sorted(directory.glob("*")) if directory.is_dir() else []:
        pid_text, start, *rest = [*entry.read_text().split(), "", ""][:3]
        pid = int(pid_text) if pid_text.isdigit() else 0
        if pid and _start_time(pid) == start:
            _killpg(pid)
            killed.append(pid)
        if rest and rest[0]:
            cg = NodeCgroup(Path(rest[0]), 2 if (Path(rest[0]) / "memory.max").exists() else 1)
            cg.kill_all()
            cg.remove()
        entry.unlink(missing_ok=True)
    if killed:
        log.warning("ended %d processes a previous run left behind: %s", len(killed), killed)
    return killed


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _drain(stream: IO[bytes], path: Path) -> None:
    """Copy what is left of a child's output into ``path`` until the child closes it."""
    with stream, open(path, "ab") as out:
        for chunk in iter(lambda: stream.readline(), b""):
            out.write(chunk)
            out.flush()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
