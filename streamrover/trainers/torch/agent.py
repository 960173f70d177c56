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
* it reports the node's health (worker state, exits, restarts left) to the job master
  under the key ``nodes/<run id>/<node id>`` (JSON), and logs it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from streamrover.ckpt import CheckpointSaver
from streamrover.shard_service import ShardClient, ShardServiceError

log = logging.getLogger(__name__)
SAVER_DRAIN_TIMEOUT = 300.0


class HealthReporter:
    """Writes this node's health document to the master's KV store (compare-and-set, last writer wins)."""

    def __init__(self, client: ShardClient | None, run_id: str, node_id: str) -> None:
        self.client = client
        self.key = f"nodes/{run_id}/{node_id}"
        self.node_id = node_id
        self.exits: list[dict[str, Any]] = []
        self._last: tuple[str, int, int] | None = None

    def report(self, state: str, restarts_left: int, round_: int, failures: dict[int, Any] | None = None) -> None:
        for rank, failure in sorted((failures or {}).items()):
            self.exits.append({"rank": rank, "pid": failure.pid, "exitcode": failure.exitcode, "at": time.time()})
        self.exits = self.exits[-50:]
        current = (state, restarts_left, len(self.exits))
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
            "at": time.time(),
        }
        log.info("node %s: workers %s, %d restarts left, %d exits so far", self.node_id, state, restarts_left,
                 len(self.exits))  # fmt: skip
        if self.client is None:
            return
        data = json.dumps(doc).encode()
        try:
            found = self.client.kv_get(self.key)
            version = found[1] if found else 0
            while True:
                ok, _, version = self.client.kv_set(self.key, data, version)
                if ok:
                    break
        except ShardServiceError as exc:  # health reports are advisory: never fail the node for one
            log.warning("could not report node health to the master: %s", exc)


def read_health(client: ShardClient, run_id: str, node_id: str) -> dict[str, Any] | None:
    """The health document a node's agent last reported (None if it never did)."""
    found = client.kv_get(f"nodes/{run_id}/{node_id}")
    return json.loads(found[0]) if found else None


class StreamroverAgent(LocalElasticAgent):
    """LocalElasticAgent that hosts the checkpoint saver and reports node health."""

    def __init__(self, *args: Any, saver_address: str | None, health: HealthReporter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._saver = CheckpointSaver(saver_address, linger=None) if saver_address else None
        self._saver_thread: threading.Thread | None = None
        self._health = health

    # -- the saver ---------------------------------------------------------------------
    def _start_saver(self) -> None:
        if self._saver is None:
            return
        self._saver.bind()  # fails loudly (EADDRINUSE) if another agent of this job already serves this node
        self._saver_thread = threading.Thread(target=self._saver.serve_forever, name="ckpt-saver", daemon=True)
        self._saver_thread.start()

    def _saver_sessions(self) -> int:
        # TODO(ckpt): use a public CheckpointSaver.wait_idle() once streamrover.ckpt offers one (see the report).
        saver = self._saver
        if saver is None:
            return 0
        with saver._lock:
            return len(saver._threads)

    def _drain_saver(self) -> None:
        """Wait until every session of the stopped workers has ended (persist-on-death included)."""
        give_up = time.monotonic() + SAVER_DRAIN_TIMEOUT
        idle = threading.Event()
        delay = 0.005
        while self._saver_sessions() > 0:
            if time.monotonic() > give_up:
                log.warning("checkpoint saver still persisting after %.0f s; starting workers anyway",
                            SAVER_DRAIN_TIMEOUT)  # fmt: skip
                return
            idle.wait(delay)  # bounded wait for the session threads to finish
            delay = min(delay * 2, 0.1)

    # -- torchelastic hooks --------------------------------------------------------------
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        super()._stop_workers(worker_group)
        self._drain_saver()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        self._health.report(
            result.state.name,
            self._remaining_restarts,
            self._rdzv_handler_round(),
            result.failures if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) else None,
        )
        return result

    def _rdzv_handler_round(self) -> int:
        holder = getattr(self._rdzv_handler, "_state_holder", None)
        return int(getattr(getattr(holder, "state", None), "round", -1))

    def run(self, role: str = "default") -> RunResult:
        self._start_saver()
        try:
            result = super().run(role)
            self._health.report("SUCCEEDED" if not result.is_failed() else "FAILED", self._remaining_restarts,
                                self._rdzv_handler_round(), result.failures)  # fmt: skip
            return result
        finally:
            if self._saver is not None and self._saver_thread is not None:
                self._saver.stop()
                self._saver_thread.join(timeout=SAVER_DRAIN_TIMEOUT)
