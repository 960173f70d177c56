"""Supervision of a job's nodes, the same on every platform: relaunch, more memory after an OOM, scale, fail.

The supervisor keeps a registry of the job's nodes (slots ``n0``, ``n1``...; a relaunch
of slot 1 is ``n1.1``, ``n1.2``: a new node id, so its rendezvous and checkpoint names
are fresh). Each :meth:`Supervisor.tick` observes every node through the platform and
reads the heartbeat its agent writes to the master (``nodes/<run id>/<node id>``), then:

* a **failed worker process** is not the supervisor's business: ``dlrover-run`` restarts
  the node's worker group in place (``restart.per_node`` times); the agent's health
  document says how many restarts are left, which ``status`` shows;
* a **lost node** (its agent killed by a signal, its machine gone, or silent for
  ``restart.heartbeat_timeout`` seconds) or a **failed node** (the agent exited non-zero:
  its in-place restarts are spent) is relaunched with the same resources;
* a node the **OOM killer** hit is stopped and relaunched with ``restart.oom.factor``
  times its memory, at most the ceiling; an OOM at the ceiling fails the job;
* every relaunch counts against ``restart.per_job``; when it is spent the job **fails**,
  with the reason in ``status``;
* **scale** to N nodes within the bounds: new slots are launched, or the highest slots
  leave gracefully, all at once (SIGTERM: the agent stops its workers, the rendezvous closes the
  round, the others re-rendezvous; rank 0 restores the newest checkpoint and resets the
  cursor, which hands every lease back);
* the job has **succeeded** once a node's agent exited 0 and every node has ended;
* a node that **failed its node check** (``health.node_check``: its agent exits
  :data:`NODE_CHECK_EXIT` before it joins) is relaunched as a new node, the check's evidence in the event;
* a **straggler** the master flags (``health.straggler_*``: its ranks' busy time per step against the
  other nodes') is shown in status; with ``straggler_policy: replace`` a new node is launched in its slot
  and the straggler leaves gracefully (the group resumes from the newest checkpoint and cursor).

Every decision is an event (time, kind, node, message) kept in the status document.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from streamrover.operator.api import LaunchError, NodeLaunch, NodeState, NodeStatus, Platform
from streamrover.operator.spec import JobSpec, format_memory
from streamrover.tokens import worker_token

log = logging.getLogger(__name__)
MAX_EVENTS = 200
CKPT_EVERY_ENV = "STREAMROVER_CKPT_EVERY"  # read by StreamSession (trainers/torch/env.py; not imported: torch)
CKPT_KEEP_ENV = "STREAMROVER_CKPT_KEEP"
EXPORT_ENV = "STREAMROVER_EXPORT"  # the spec's export section as JSON: streamrover.serving.ExportConfig.from_env()
NODE_CHECK_EXIT = 86  # a node that failed its check (trainers/torch/nodecheck.py; not imported: torch)
HealthReader = Callable[[str, str], "dict[str, Any] | None"]  # (run id, node id) -> the agent's health document


class JobPhase(enum.Enum):
    """Where a job is in its life; the last three are final."""
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def ended(self) -> bool:
        """Whether the phase is final (succeeded, failed or stopped)."""
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


@dataclass
class NodeRecord:
    """One node as the supervisor knows it."""

    node_id: str
    slot: int
    generation: int
    memory: int | None
    launched_at: float
    state: NodeState = NodeState.PENDING
    exit_code: int | None = None
    oom_kills: int = 0
    pid: int | None = None
    detail: str = ""
    heartbeat_at: float | None = None  # wall clock of the agent's last health write
    restarts_left: int | None = None
    workers: dict[str, int] = field(default_factory=dict)
    worker_exits: int = 0
    node_check: dict[str, Any] | None = None  # its pre-flight check's result (the agent's health document)
    hangs: int = 0  # hung worker groups its agent restarted
    replaced_by: str = ""  # the node that replaced it (a straggler)
    handled: bool = False  # its end was acted on (relaunched, counted)
    launched: bool = True  # False: the platform could not start it (nothing to observe)

    def view(self, now: float) -> dict[str, Any]:
        """The node as the status document shows it (at time ``now``)."""
        out = asdict(self)
        out["state"] = self.state.value
        out["memory"] = format_memory(self.memory) if self.memory else None
        out["heartbeat_age"] = round(now - self.heartbeat_at, 1) if self.heartbeat_at else None
        del out["handled"], out["launched"]
        return out


@dataclass(frozen=True)
class Event:
    """Something that happened to the job or one of its nodes (``node`` empty: the job), for status."""
    at: float
    kind: str
    node: str
    message: str


class Supervisor:
    """Keeps a job's nodes as its spec and the operator's requests say (see the module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        platform: Platform,
        *,
        run_id: str,
        master_address: str,
        token: str,
        ckpt_url: str,
        health: HealthReader | None = None,
        clock: Callable[[], float] = time.time,
        stop_grace: float = 60.0,
        client_env: dict[str, str] | None = None,
    ) -> None:
        self.client_env = dict(client_env or {})  # how nodes reach the master (STREAMROVER_TLS_CA...)
        self.spec = spec
        self.platform = platform
        self.run_id = run_id
        self.master_address = master_address
        self.token = token
        self.ckpt_url = ckpt_url
        self.health = health
        self.clock = clock
        self.stop_grace = stop_grace
        self.phase = JobPhase.STARTING
        self.reason = ""
        lo, _ = spec.scale_bounds
        self.desired = lo
        self.nodes: dict[str, NodeRecord] = {}  # every node ever launched, by id
        self.slots: dict[int, str] = {}  # slot -> its current node id
        self.generations: dict[int, int] = {}  # slot -> the generation of its newest node
        self.relaunches = 0
        self.replacements = 0  # stragglers replaced (each also counts as a relaunch)
        self.paces: list[dict[str, Any]] = []  # the master's per-node pace, newest sample (status: stragglers)
        self.events: list[Event] = []

    # -- events and the status document ----------------------------------------------------
    def event(self, kind: str, node: str, message: str) -> None:
        """Record an event (the newest ``MAX_EVENTS`` are kept) and log it."""
        self.events.append(Event(self.clock(), kind, node, message))
        del self.events[:-MAX_EVENTS]
        log.info("%s %s: %s", kind, node or "job", message)

    def status(self) -> dict[str, Any]:
        """The job's status document: phase, nodes, scale, the master, recent events."""
        now = self.clock()
        lo, hi = self.spec.scale_bounds
        health = self.spec.health
        return {
            "job": self.spec.name,
            "platform": self.platform.name,
            "run_id": self.run_id,
            "phase": self.phase.value,
            "reason": self.reason,
            "master": self.master_address,
            "desired_nodes": self.desired,
            "bounds": [lo, hi],
            "relaunches": self.relaunches,
            "relaunch_budget": self.spec.restart.per_job,
            "replacements": self.replacements,
            "stragglers": {"policy": health.straggler_policy, "threshold": health.straggler_threshold,
                           "window_seconds": health.straggler_window_seconds, "nodes": self.paces},
            "nodes": [self.nodes[nid].view(now) for nid in sorted(self.slots.values(), key=self._slot_of)],
            "ended_nodes": [r.view(now) for r in self.nodes.values() if r.node_id not in self.slots.values()][-20:],
            "events": [asdict(e) for e in self.events[-50:]],
            "updated_at": now,
        }

    def _slot_of(self, node_id: str) -> int:
        return self.nodes[node_id].slot

    # -- launching -----------------------------------------------------------------------------
    def node_command(self, node_id: str) -> list[str]:
        """``dlrover-run`` for one node: the spec's trainer, elastic within its node range."""
        t, r, h = self.spec.trainer, self.spec.restart, self.spec.health
        health = ["--node-check", "--node-check-threshold", str(h.node_check_threshold)] if h.node_check else []
        if h.hang_timeout_seconds > 0:
            health += ["--hang-timeout", str(h.hang_timeout_seconds)]
        return [
            sys.executable, "-m", "streamrover.trainers.torch.run",
            "--nnodes", str(t.nodes), "--nproc-per-node", str(t.nproc_per_node), "--max-restarts", str(r.per_node),
            "--rdzv-backend", "streamrover", "--rdzv-id", self.run_id,
            "--rdzv-conf", "last_call_timeout=1,join_timeout=600",
            "--shard-service", self.master_address, "--ckpt-dir", self.ckpt_url, "--node-id", node_id,
            *health, *self.platform.launcher_args(), *t.launcher_args, t.script, *t.args,
        ]  # fmt: skip

    def _launch(self, slot: int, memory: int | None, why: str) -> NodeRecord:
        generation = self.generations.get(slot, -1) + 1  # never reuse a node id: rendezvous and shm names
        self.generations[slot] = generation
        node_id = f"n{slot}" if generation == 0 else f"n{slot}.{generation}"
        env = {
            "STREAMROVER_TOKEN": worker_token(self.token),  # the worker role: it cannot administer the job
            CKPT_EVERY_ENV: str(self.spec.checkpoint.every_steps),
            CKPT_KEEP_ENV: str(self.spec.checkpoint.keep_last),
            **({EXPORT_ENV: self.spec.export.model_dump_json()} if self.spec.export is not None else {}),
            **self.client_env,
            **self.spec.trainer.env,
        }
        launch = NodeLaunch(self.spec.name, node_id, self.node_command(node_id), env, memory, self.spec.trainer.cpu)
        record = NodeRecord(node_id, slot, generation, memory, self.clock())
        self.nodes[node_id] = record
        self.slots[slot] = node_id
        try:
            self._apply(record, self.platform.launch_node(launch))
        except LaunchError as exc:
            record.state, record.detail, record.launched = NodeState.FAILED, f"could not launch: {exc}", False
        mem = f", memory {format_memory(memory)}" if memory else ""
        self.event("launch", node_id, f"{why}{mem}")
        return record

    def start(self) -> None:
        """Launch the first nodes (the lower bound of the node range)."""
        for slot in range(self.desired):
            self._launch(slot, self.spec.trainer.memory, "initial node")
        self.phase = JobPhase.RUNNING

    # -- one supervision pass ---------------------------------------------------------------------
    def tick(self) -> None:
        """Observe every current node and act on what ended; then bring the node count to ``desired``."""
        if self.phase.ended:
            return
        for slot, node_id in sorted(self.slots.items()):
            record = self.nodes[node_id]
            if record.handled:
                continue
            if record.launched:
                self._apply(record, self.platform.observe(node_id))
                self._read_health(record)
            if record.state is NodeState.RUNNING and self._silent(record):
                self.event("heartbeat", node_id, f"no heartbeat for {self.spec.restart.heartbeat_timeout:.0f} s")
                self._apply(record, self.platform.stop_node(node_id, grace=5.0))
                record.state, record.detail = NodeState.LOST, "silent: no heartbeat"
            if record.state.ended:
                self._ended(slot, record)
            if self.phase.ended:
                return
        self._finish_if_done()
        if not self.phase.ended and not self._any_succeeded():
            self._reconcile()

    def _apply(self, record: NodeRecord, status: NodeStatus) -> None:
        record.state, record.exit_code, record.oom_kills = status.state, status.exit_code, status.oom_kills
        record.pid, record.detail = status.pid, status.detail  # an empty detail is news too: "Pending" is over

    def _read_health(self, record: NodeRecord) -> None:
        if self.health is None:
            return
        try:
            doc = self.health(self.run_id, record.node_id)
        except Exception as exc:  # the master may be restarting: heartbeats are advisory until the timeout
            log.debug("could not read %s's health: %s", record.node_id, exc)
            return
        if doc:
            record.heartbeat_at = float(doc.get("heartbeat_at") or doc.get("at") or 0.0)
            record.restarts_left = doc.get("restarts_left")
            record.workers = dict(doc.get("workers", {}))
            record.worker_exits = len(doc.get("exits", []))
            record.node_check = doc.get("node_check") or record.node_check
            record.hangs = len(doc.get("hangs") or [])

    def _silent(self, record: NodeRecord) -> bool:
        limit = self.spec.restart.heartbeat_timeout
        last = record.heartbeat_at or record.launched_at
        return self.clock() - max(last, record.launched_at) > limit

    def _ended(self, slot: int, record: NodeRecord) -> None:
        """Act once on a node that ended."""
        record.handled = True
        state = record.state
        if state is NodeState.SUCCEEDED:
            self.event("succeeded", record.node_id, "training finished on this node")
            return
        if state is NodeState.STOPPED:
            return
        if self._any_succeeded():
            self.event("ended", record.node_id, f"{state.value} after training finished; not relaunched")
            return
        memory = record.memory
        if state is NodeState.OOM_KILLED:
            if record.exit_code is None:  # the agent lives on (the OOM killer took a worker): it must go
                self._apply(record, self.platform.stop_node(record.node_id, grace=5.0))
                record.state = NodeState.OOM_KILLED
            ceiling = self.spec.memory_ceiling
            if memory is None or ceiling is None:
                reason = "OOM-killed with no memory limit to raise"
                return self._fail(f"node {record.node_id} {reason}")
            if memory >= ceiling:
                return self._fail(f"node {record.node_id} was OOM-killed at the memory ceiling "
                                  f"{format_memory(ceiling)} (restart.oom.max_memory)")  # fmt: skip
            memory = min(int(memory * self.spec.restart.oom.factor), ceiling)
            self.event("oom", record.node_id, f"OOM-killed at {format_memory(record.memory or 0)}; relaunching with "
                                              f"{format_memory(memory)}")  # fmt: skip
        elif state is NodeState.FAILED and record.exit_code == NODE_CHECK_EXIT:
            self._read_health(record)  # the verdict it wrote before it left
            evidence = _check_evidence(record.node_check)
            self.event("node-check", record.node_id, f"failed its node check ({evidence}): relaunching as a new node")
        else:
            why = record.detail or (f"exit code {record.exit_code}" if record.exit_code is not None else state.value)
            self.event(state.value, record.node_id, why)
        if slot >= self.desired:
            return  # the job was scaled in meanwhile: the slot is not wanted
        if self.relaunches >= self.spec.restart.per_job:
            why = record.detail or record.exit_code
            return self._fail(f"node {record.node_id} {state.value} ({why}) and the job's "
                              f"{self.spec.restart.per_job} node relaunches (restart.per_job) are spent")  # fmt: skip
        self.relaunches += 1
        self._launch(slot, memory, f"relaunch of {record.node_id} ({state.value})")

    def _fail(self, reason: str) -> None:
        self.phase, self.reason = JobPhase.FAILED, reason
        self.event("failed", "", reason)
        self.stop_all("the job failed")

    def _any_succeeded(self) -> bool:
        return any(self.nodes[n].state is NodeState.SUCCEEDED for n in self.slots.values())

    def _finish_if_done(self) -> None:
        current = [self.nodes[n] for n in self.slots.values()]
        if current and all(r.state.ended for r in current) and self._any_succeeded():
            self.phase, self.reason = JobPhase.SUCCEEDED, "training finished"
            self.event("succeeded", "", "every node has ended; training finished")

    # -- stragglers ----------------------------------------------------------------------------------
    def observe_paces(self, paces: list[dict[str, Any]]) -> None:
        """The master's per-node pace (``Status.node_paces`` as dicts); with ``straggler_policy: replace`` a flagged
        node of this job is replaced: a new node in its slot, the straggler leaving gracefully."""
        self.paces = paces
        flagged = {p["node"]: p for p in paces if p.get("straggler")}
        current = {nid: slot for slot, nid in self.slots.items()}
        for node_id, pace in sorted(flagged.items()):
            if node_id not in current or self.phase.ended:
                continue  # another job's node, or one already replaced (its reports are not stale yet)
            record = self.nodes[node_id]
            if record.state is not NodeState.RUNNING or record.handled:
                continue
            evidence = (f"busy {pace['busy_per_step'] * 1000:.1f} ms/step, {pace['ratio']:.1f}x the other nodes' "
                        f"median {pace['median_others'] * 1000:.1f} ms for {pace['beyond_seconds']:.0f} s "
                        f"(threshold {pace['threshold']:g}x for {pace['window_seconds']:g} s)")  # fmt: skip
            policy = self.spec.health.straggler_policy
            self.event("straggler", node_id, f"{evidence}; policy {policy}")
            if policy == "replace":
                self._replace(current[node_id], record)

    def _replace(self, slot: int, record: NodeRecord) -> None:
        if self.relaunches >= self.spec.restart.per_job:
            self.event("straggler", record.node_id, "not replaced: the node relaunches (restart.per_job) are spent")
            return
        self.relaunches += 1
        self.replacements += 1
        new = self._launch(slot, record.memory, f"replaces straggler {record.node_id}")
        record.replaced_by, record.handled = new.node_id, True
        self.event("scale-in", record.node_id, f"replaced by {new.node_id}: leaving gracefully")
        self._apply(record, self.platform.stop_node(record.node_id, grace=self.stop_grace))

    # -- scaling -----------------------------------------------------------------------------------
    def scale(self, nodes: int, why: str = "requested") -> None:
        """Ask for ``nodes`` nodes; refused (ValueError) outside the spec's bounds."""
        lo, hi = self.spec.scale_bounds
        if not lo <= nodes <= hi:
            raise ValueError(f"{nodes} nodes is outside this job's bounds {lo}:{hi}")
        if nodes != self.desired:
            self.event("scale", "", f"{self.desired} -> {nodes} nodes ({why})")
        self.desired = nodes

    def _reconcile(self) -> None:
        active = {s: n for s, n in self.slots.items() if not self.nodes[n].state.ended}
        leaving = [active[slot] for slot in sorted(active, reverse=True) if slot >= self.desired]
        for node_id in leaving:
            self.event("scale-in", node_id, "leaving gracefully")
        # all at once: each node that leaves makes the others re-rendezvous, so one after the other is a pause each
        stopped = []
        if leaving:
            with ThreadPoolExecutor(len(leaving), thread_name_prefix="scale-in") as pool:
                stopped = list(pool.map(lambda n: self.platform.stop_node(n, grace=self.stop_grace), leaving))
        for node_id, status in zip(leaving, stopped, strict=True):
            self._apply(self.nodes[node_id], status)
            self.nodes[node_id].handled = True
            del self.slots[self.nodes[node_id].slot]
        for slot in range(self.desired):
            if slot not in self.slots or self.nodes[self.slots[slot]].state is NodeState.STOPPED:
                self._launch(slot, self.spec.trainer.memory, "scale-out")

    def stop_all(self, why: str) -> None:
        """Stop every running node (job stop or failure); the phase says which."""
        for node_id in list(self.slots.values()):
            record = self.nodes[node_id]
            if not record.state.ended:
                self._apply(record, self.platform.stop_node(node_id, grace=self.stop_grace))
                record.handled = True
                self.event("stop", node_id, why)
        if not self.phase.ended:
            self.phase, self.reason = JobPhase.STOPPED, why


def status_json(status: dict[str, Any]) -> str:
    """A status document as JSON text."""
    return json.dumps(status, indent=2, sort_keys=True, default=str)


def _check_evidence(check: dict[str, Any] | None) -> str:
    """A node check's result (nodecheck.CheckResult as a dict) in a few words."""
    if not check:
        return "no result reported"
    if check.get("error"):
        return f"probe failed: {check['error']}"
    ratio, median = check.get("ratio"), check.get("median_s")
    versus = f", {ratio:.1f}x the median {median:.3f} s of {check.get('peers')} peers" if ratio and median else ""
    return f"compute probe {check.get('compute_s', 0):.3f} s{versus}, threshold {check.get('threshold')}x"
