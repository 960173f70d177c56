"""The elastic agent of ``dlrover-run``: torchelastic's LocalElasticAgent plus streamrover's duties.

What torchelastic already does (and we keep): start ``--nproc-per-node`` workers,
restart the whole local worker group when one fails (up to ``--max-restarts``)
without restarting the node, and re-rendezvous when nodes join or leave within
``--nnodes MIN:MAX``. What this agent adds:

* it hosts the node's :class:`~streamrover.ckpt.CheckpointSaver` in a thread, so
  shared-memory snapshots outlive the workers and a dead worker's newest snapshot is
  persisted at once (the saver sees its connection close);
* before new workers start (after a failure or a membership change) it waits until
  that persist is finished, so no rank of the next round loads a checkpoint while an
  older timeline is still being written;
* it keeps warm standby interpreters (:mod:`~streamrover.trainers.standby`) and
  starts restarted workers in them, so a restart does not pay ``import torch`` again;
* it reports the node's health (worker state, exits, restarts left) to the job master
  under the key ``nodes/<run id>/<node id>`` (JSON), and logs it;
* with ``--node-check`` it checks the node before its first rendezvous (:mod:`~streamrover.trainers.torch.nodecheck`)
  and leaves (exit :data:`~streamrover.trainers.torch.nodecheck.NODE_CHECK_EXIT`) if it is slow or broken;
* with ``--hang-timeout T`` it watches its workers' progress marks (:mod:`~streamrover.trainers.torch.pace`):
  a worker whose mark is older than T seconds is stuck (in a collective whose peer stopped, say); the agent
  SIGKILLs its workers and restarts the group (a worker restart: ``--max-restarts``), which makes every other
  node's workers fail their next collective and restart too. A hang is seen within T + ``--monitor-interval``
  + :data:`~streamrover.trainers.torch.pace.MARK_EVERY` seconds of the last progress.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from streamrover.ckpt import CheckpointSaver, purge_shared_memory
from streamrover.shard_service import ShardClient, ShardServiceError
from streamrover.trainers.standby import StandbyPool
from streamrover.trainers.torch.pace import progress_ages
from streamrover.trainers.torch.rendezvous import no_first_round_skew

log = logging.getLogger(__name__)
SAVER_DRAIN_TIMEOUT = 300.0
MONITOR_TICK = 1e-4  # torchelastic's sleep between monitor calls; ours waits in ExitWatch.wait instead


class HealthReporter:
    """Writes this node's health document to the master's KV store (compare-and-set, last writer wins)."""

    def __init__(self, client: ShardClient | None, run_id: str, node_id: str) -> None:
        self.client = client
        self.key = f"nodes/{run_id}/{node_id}"
        self.node_id = node_id
        self.exits: list[dict[str, Any]] = []
        self._last: tuple[str, int, int, int, tuple[int, ...], int] | None = None
        self._doc: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._beat: threading.Thread | None = None
        self.node_check: dict[str, Any] | None = None  # the pre-flight check's result (nodecheck.py)
        self.hangs: list[dict[str, Any]] = []  # hung worker groups this agent restarted (the newest 20)
        self.clock = time.monotonic
        self._grace = 0.0  # no report for this long: the master is unreachable (start_heartbeat sets it)
        self._answered_at: float | None = None  # the master's last answer to a report
        self._back_at: float | None = None  # when it answered again after a silence longer than the grace
        self._version: int | None = None  # the health key's version after this reporter's last write

    def start_heartbeat(self, interval: float) -> None:
        """Rewrite the health document every ``interval`` seconds (``heartbeat_at``): the node is alive."""
        if self.client is None or interval <= 0 or self._beat is not None:
            return
        self._grace = 2 * interval + 2.0
        self._beat = threading.Thread(target=self._heartbeats, args=(interval,), name="node-heartbeat", daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeats (waits up to 10 s for the heartbeat thread)."""
        self._stopped.set()
        if self._beat is not None:
            self._beat.join(timeout=10)

    def _heartbeats(self, interval: float) -> None:
        while not self._stopped.wait(interval):  # the heartbeat period
            self._write(None)

    def report(
        self,
        state: str,
        restarts_left: int,
        round_: int,
        failures: dict[int, Any] | None = None,
        standby_ready: int = 0,
        pids: dict[int, int] | None = None,
    ) -> None:
        """Write the node's health if it changed: worker state, restarts left, exits, warm standbys, worker pids."""
        for rank, failure in sorted((failures or {}).items()):
            self.exits.append({"rank": rank, "pid": failure.pid, "exitcode": failure.exitcode, "at": time.time()})
        self.exits = self.exits[-50:]
        workers = {str(rank): pid for rank, pid in sorted((pids or {}).items())}
        current = (state, restarts_left, len(self.exits), standby_ready, tuple(workers.values()), len(self.hangs))
        if current == self._last:
            return
        self._last = current
        doc = {
            "node": self.node_id,
            "host": socket.gethostname(),
            "agent_pid": os.getpid(),
            "state": state,
            "restarts_left": restarts_left,
            "round": round_,
            "exits": self.exits,
            "standby_ready": standby_ready,
            "workers": workers,  # local rank -> pid
            "at": time.time(),
            **({"node_check": self.node_check} if self.node_check is not None else {}),
            **({"hangs": self.hangs} if self.hangs else {}),
        }
        log.info("node %s: workers %s, %d restarts left, %d exits so far, %d standbys warm", self.node_id, state,
                 restarts_left, len(self.exits), standby_ready)  # fmt: skip
        self._write(doc)

    def _write(self, doc: dict[str, Any] | None) -> None:
        """Write ``doc`` (None: the last one again, as a heartbeat); one writer at a time, newest wins."""
        with self._lock:
            if doc is not None:
                self._doc = doc
            self._send(self._doc or {"node": self.node_id, "state": "STARTING", "agent_pid": os.getpid()})

    def _send(self, doc: dict[str, Any]) -> None:
        if self.client is None:
            return
        data = json.dumps({**doc, "heartbeat_at": time.time()}).encode()
        try:
            if self._version is None:
                found = self.client.kv_get(self.key)
                version = found[1] if found else 0
            else:  # the version this reporter wrote last: one call, not two (a failed group's restart waits for it)
                version = self._version
            while True:
                ok, _, version = self.client.kv_set(self.key, data, version)
                if ok:
                    self._version = version
                    break
            now = self.clock()
            if self._answered_at is not None and self._grace and now - self._answered_at > self._grace:
                self._back_at = now  # the master answers again after an outage
            self._answered_at = now
        except ShardServiceError as exc:  # health reports are advisory: never fail the node for one
            log.warning("could not report node health to the master: %s", exc)

    def outage_age(self) -> float | None:
        """For the hang watch: 0 while the master is unreachable (no report answered for two heartbeat intervals
        and 2 s), the seconds since it answered again after an outage, or None (no outage seen, or no heartbeats to
        tell).

        Workers wait for a master that is down (their calls retry), so they make no progress then: that is not a
        hang. The agent counts a worker's time without progress only from the master's return."""
        if not self._grace or self._answered_at is None:
            return None
        now = self.clock()
        if now - self._answered_at > self._grace:
            return 0.0
        return now - self._back_at if self._back_at is not None else None


def stuck_ranks(ages: dict[int, float], hang_timeout: float, outage_age: float | None) -> dict[int, float]:
    """The local ranks whose progress marks are older than ``hang_timeout`` (their ages), a master outage's time
    not counted (:meth:`HealthReporter.outage_age`)."""
    if outage_age is not None:
        ages = {rank: min(age, outage_age) for rank, age in ages.items()}
    return {rank: age for rank, age in ages.items() if age > hang_timeout}


def read_health(client: ShardClient, run_id: str, node_id: str) -> dict[str, Any] | None:
    """The health document a node's agent last reported (None if it never did)."""
    found = client.kv_get(f"nodes/{run_id}/{node_id}")
    return json.loads(found[0]) if found else None


def _proc_state(pid: int) -> str:
    """A process's state letter from /proc (``T``: stopped, ``S``: sleeping...), or ``?``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class ExitWatch:
    """Wakes the agent's monitor loop as soon as a worker process exits, instead of at its next
    ``--monitor-interval`` tick (a pidfd per worker, Linux >= 5.3; elsewhere it sleeps the interval)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pidfd -> pid

    def watch(self, pids: list[int]) -> None:
        """Watch these workers (the ones watched before are dropped)."""
        self.close()
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:  # exited already: the monitor's next look sees it
                continue
            except (OSError, AttributeError):  # no pidfd here: sleep the interval (torchelastic's own way)
                self.close()
                return

    def wait(self, timeout: float) -> None:
        """Return after ``timeout`` seconds, or at once when a watched worker has exited (each exit wakes once)."""
        if not self._fds:
            time.sleep(timeout)
            return
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(timeout * 1000):
            self._fds.pop(fd, None)
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class PidfdPopen(subprocess.Popen[bytes]):
    """A worker's Popen whose ``wait(timeout)`` returns when the process exits (a pidfd), not at the next of
    Popen's own polls, which back off to 50 ms apart: torchelastic waits so for every worker it stops (the
    survivors of a group in which one died), before it restarts the group. The agent sets it on the Popen objects
    of the workers it starts (:meth:`StreamroverAgent._start_workers`)."""

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None or self.returncode is not None:
            return super().wait(timeout)
        try:
            fd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):  # reaped elsewhere, or no pidfd here: Popen's own wait
            return super().wait(timeout)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(timeout * 1000)
        finally:
            os.close(fd)
        try:
            return super().wait(0)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout) from None


def progress_directory() -> Path:
    """A fresh directory for this agent's workers' progress marks (``--hang-timeout``)."""
    return Path(tempfile.mkdtemp(prefix="streamrover-progress-"))


class StreamroverAgent(LocalElasticAgent):
    """LocalElasticAgent that hosts the checkpoint saver and reports node health."""

    def __init__(
        self,
        *args: Any,
        saver_address: str | None,
        health: HealthReporter,
        ckpt_namespace: str | None = None,
        standby: StandbyPool | None = None,
        hang_timeout: float = 0.0,
        progress_dir: Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # torchelastic sleeps --monitor-interval between looks at its workers, so a dead worker was seen 0.05 s
        # later on average (0.1 s at worst); the exit watch wakes it at once, and waits the interval otherwise
        spec = self._worker_group.spec
        self._monitor_interval = spec.monitor_interval
        spec.monitor_interval = MONITOR_TICK
        self._exits = ExitWatch()
        self._rendezvoused = False
        self._hang_timeout = hang_timeout if progress_dir is not None else 0.0
        self._progress_dir = progress_dir
        self._standby = standby
        self._saver = CheckpointSaver(saver_address, linger=None) if saver_address else None
        self._namespace = ckpt_namespace
        self._succeeded = False
        self._saver_thread: threading.Thread | None = None
        self._health = health

    # -- the saver ---------------------------------------------------------------------
    def _start_saver(self) -> None:
        if self._saver is None:
            return
        self._saver.bind()  # fails loudly (EADDRINUSE) if another agent of this job already serves this node
        self._saver_thread = threading.Thread(target=self._saver.serve_forever, name="ckpt-saver", daemon=True)
        self._saver_thread.start()

    def _drain_saver(self) -> None:
        """Wait until every session of the stopped workers has ended (persist-on-death included)."""
        if self._saver is not None and not self._saver.wait_idle(SAVER_DRAIN_TIMEOUT):
            log.warning("checkpoint saver still persisting after %.0f s; starting workers anyway", SAVER_DRAIN_TIMEOUT)

    # -- torchelastic hooks --------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._progress_dir is not None:  # a new attempt: no worker has made progress in it yet
            for mark in self._progress_dir.glob("progress-*"):
                mark.unlink(missing_ok=True)
        if self._standby is None:
            pids = super()._start_workers(worker_group)
            self._watch(pids)
            return pids
        served = self._standby.served
        log.info("rendezvous done: starting %d workers", len(worker_group.workers))
        with self._standby.serving():
            pids = super()._start_workers(worker_group)
        self._watch(pids)
        log.info("started %d workers, %d in warm standbys", len(pids), self._standby.served - served)
        self._standby.schedule_fill()  # later: the standbys' imports would slow these workers' start-up
        return pids

    def _watch(self, pids: dict[int, int]) -> None:
        """Wake the monitor loop at these workers' exits, and torchelastic's waits for them as they end."""
        self._exits.watch(list(pids.values()))
        for handler in getattr(self._pcontext, "subprocess_handlers", {}).values():
            if type(handler.proc) is subprocess.Popen:
                handler.proc.__class__ = PidfdPopen

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if not self._rendezvoused:  # the first join keeps torch's random skew of the nodes' joins
            self._rendezvoused = True
            super()._rendezvous(worker_group)
            return
        with no_first_round_skew():  # a restart: no 0-0.3 s sleep (rendezvous.py)
            super()._rendezvous(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        super()._stop_workers(worker_group)
        stopped = time.monotonic()
        self._drain_saver()
        log.info("workers stopped in %.3f s, checkpoint saver drained in %.3f s", stopped - started,
                 time.monotonic() - stopped)  # fmt: skip

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._exits.wait(self._monitor_interval)
        result = super()._monitor_workers(worker_group)
        if result.state is WorkerState.HEALTHY and self._hang_timeout > 0 and self._hung(worker_group):
            return RunResult(state=WorkerState.UNHEALTHY)  # torchelastic restarts the group (a worker restart)
        self._health.report(
            result.state.name,
            self._remaining_restarts,
            self._rdzv_handler_round(),
            result.failures if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) else None,
            self._standby.ready() if self._standby is not None else 0,
            {w.local_rank: w.id for w in worker_group.workers if w.id is not None},
        )
        return result

    def _hung(self, worker_group: WorkerGroup) -> bool:
        """Whether a worker's progress mark is older than the hang timeout; if so its group is SIGKILLed (a stuck
        process ignores the SIGTERM torchelastic would send first and wait ``shutdown_timeout`` on)."""
        assert self._progress_dir is not None
        stuck = stuck_ranks(progress_ages(self._progress_dir), self._hang_timeout, self._health.outage_age())
        if not stuck:
            return False
        pids = {w.local_rank: w.id for w in worker_group.workers if w.id is not None}
        states = {rank: _proc_state(pid) for rank, pid in pids.items()}
        hang = {"at": time.time(), "stuck": {str(r): round(a, 1) for r, a in sorted(stuck.items())},
                "timeout": self._hang_timeout, "states": {str(r): s for r, s in sorted(states.items())}}  # fmt: skip
        self._health.hangs = [*self._health.hangs, hang][-20:]
        log.warning("hung workers: local ranks %s made no progress for %s s (> --hang-timeout %.0f s; process "
                    "states %s): killing the group to restart it", sorted(stuck), hang["stuck"], self._hang_timeout,
                    hang["states"])  # fmt: skip
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        self._health.report("HUNG", self._remaining_restarts, self._rdzv_handler_round(), None,
                            self._standby.ready() if self._standby is not None else 0, pids)  # fmt: skip
        return True

    def _rdzv_handler_round(self) -> int:
        holder = getattr(self._rdzv_handler, "_state_holder", None)
        return int(getattr(getattr(holder, "state", None), "round", -1))

    def run(self, role: str = "default") -> RunResult:
        """Run the workers as torch's agent does (with the checkpoint saver started first); the health of the run is
        reported to the master.
        """
        self._start_saver()
        if self._standby is not None:  # warm while this node waits in its first rendezvous (a joining node's
            self._standby.schedule_fill(0.0)  # group forms only after the others stopped theirs)
        try:
            result = super().run(role)
            self._succeeded = not result.is_failed()
            self._health.report("SUCCEEDED" if not result.is_failed() else "FAILED", self._remaining_restarts,
                                self._rdzv_handler_round(), result.failures)  # fmt: skip
            return result
        finally:
            self._exits.close()
            if self._standby is not None:
                self._standby.close()
            if self._progress_dir is not None:
                shutil.rmtree(self._progress_dir, ignore_errors=True)
            if self._saver is not None and self._saver_thread is not None:
                self._saver.stop()
                self._saver_thread.join(timeout=SAVER_DRAIN_TIMEOUT)
            if self._succeeded and self._namespace is not None:
                # the job ended well: its last checkpoint is durable, nobody restarts here from memory
                removed = purge_shared_memory(self._namespace)
                log.info("freed %d checkpoint buffers from shared memory", len(removed))
