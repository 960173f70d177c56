"""``PSTrainer``: the chief of a TF parameter-server job, feeding leased shards to scheduled steps, exactly once.

The design (why each record's effect is in the PS variables exactly once, and how worker, PS
and chief failures are handled) is in :mod:`streamrover.trainers.tensorflow.api`; the rules it
keeps are the trainer contract's (:mod:`streamrover.trainers.api`). A script::

    trainer = PSTrainer()                                  # the cluster the launcher built
    with trainer.strategy.scope():
        model, opt = Model(), Adagrad(0.1)
        opt.build(model.trainable_variables)

    def step(batch):                                       # a tf.function, run on a worker
        with tf.GradientTape() as tape:
            loss = model.loss(batch)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    trainer.fit(step, {"model": model, "opt": opt}, dataset="clicks", batch_size=256)

The user writes the step; the trainer leases, reads, schedules, acks, checkpoints and restores.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import tensorflow as tf

from streamrover.ckpt import Checkpointer, RetentionPolicy
from streamrover.cursor import DataCursor
from streamrover.shard_service import AckFailedError, LeasedShard, LeaseLostError, ShardClient, ShardService
from streamrover.trainers.api import restore_before_lease
from streamrover.trainers.tensorflow.api import (
    EXIT_RESTART,
    ParameterServerLostError,
    PSTrainingError,
    TrainerEnv,
)
from streamrover.trainers.tensorflow.feed import END, IDLE, Batch, LeaseFeed
from streamrover.trainers.tensorflow.state import load_variables_state, variables_state

log = logging.getLogger(__name__)
_PS_LOST = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError, tf.errors.NotFoundError)


def default_partitioner(num_ps: int, min_shard_bytes: int = 256 << 10) -> Callable[..., list[int]]:
    """Shard floating-point variables of at least ``min_shard_bytes`` across the parameter servers along
    their first axis; integer variables (ledgers, counters) stay whole on one server."""
    sizer = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=min_shard_bytes, max_shards=num_ps
    )

    def partition(shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        if not tf.as_dtype(dtype).is_floating:
            return [1] * len(shape)
        return list(sizer(shape, dtype, axis))

    return partition


class _CutBinder:
    """The shard service as the checkpointer's binder, remembering the cursor of the last cut it took."""

    def __init__(self, client: ShardService) -> None:
        self.client = client
        self.last_cursor = DataCursor()

    def prepare_cut(self, step: int | None, *, persisting: bool = False) -> tuple[int, DataCursor]:
        cut_id, cursor = self.client.prepare_cut(step, persisting=persisting)
        self.last_cursor = cursor
        return cut_id, cursor

    @property
    def run_id(self) -> str | None:
        return self.client.run_id

    def commit_cut(self, cut_id: int) -> object:
        return self.client.commit_cut(cut_id)

    def restore_cursor(self, cursor: DataCursor, *, from_memory: bool = False, **snapshot: Any) -> object:
        return self.client.restore_cursor(cursor, from_memory=from_memory, **snapshot)  # its cut and run


@dataclass
class _Step:
    step: int
    value: Any  # the coordinator's RemoteValue
    acks: list[tuple[LeasedShard, int]] = field(default_factory=list)


@dataclass
class FitResult:
    """How :meth:`PSTrainer.fit` ended."""

    step: int
    records: int  # positions in the last checkpoint's cursor
    rollbacks: int
    restored_from: str | None
    stopped: bool  # ended by SIGTERM (a membership change), not by the data


class PSTrainer:
    """The chief: strategy, coordinator, shard client and checkpointer of one TF-PS job."""

    def __init__(
        self,
        env: TrainerEnv | None = None,
        *,
        variable_partitioner: Callable[..., list[int]] | None = None,
        ckpt_every: int = 50,
        retention: RetentionPolicy | None = None,
        max_inflight: int | None = None,
        exporter: Any | None = None,
    ) -> None:
        """``exporter``: a :class:`~streamrover.serving.savedmodel.SavedModelExporter` (every durable checkpoint
        becomes a SavedModel version; versions above a restored step are retired first)."""
        started = time.monotonic()
        faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 CHIEF`: every thread's stack
        self.env = env or TrainerEnv.from_env()
        spec = self.env.cluster
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec.as_tf()), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=variable_partitioner or default_partitioner(len(spec.ps))
        )
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)
        self._reruns = threading.Event()
        self.reruns = 0
        self._hook_reruns()
        self.ckpt_every = ckpt_every
        self.max_inflight = max_inflight or 2 * len(spec.workers)
        name = f"tf-chief:{os.getpid()}"
        self.client = ShardClient(self.env.master, token=self.env.token, name=name, async_acks=True)
        self.client.join()
        self._binder = _CutBinder(self.client)
        self.exporter = exporter
        if exporter is not None:
            exporter.bind_checkpoints(self.env.ckpt_dir)
            exporter.report = lambda values: self.client.report(
                values, step=max(int(values["export_version"]), 0), reporter="serving")
        self.checkpointer = Checkpointer(
            self.env.ckpt_dir,
            binder=self._binder,
            retention=retention or RetentionPolicy(keep_last=3),
            job=self.env.ckpt_job,
            on_durable=exporter.on_durable if exporter is not None else None,
        )
        self.step = 0
        self.rollbacks = 0
        self.restored_from: str | None = None
        self.timings: dict[str, float] = {"connect": time.monotonic() - started}
        self._stop_requested = False
        self._state: Mapping[str, Any] = {}
        self._inflight: deque[_Step] = deque()
        self._feed: LeaseFeed | None = None
        self._last_ckpt_step = -1
        self._lease_lost = False
        self._on_result: Callable[[int, Any], None] | None = None
        self._resumed_pending = False
        self._step_failed: str | None = None
        self._unacked: dict[str, tuple[LeasedShard, int, int]] = {}  # coalesced progress: shard -> (shard, end, step)

    # -- failure detection ----------------------------------------------------------------
    def _hook_reruns(self) -> None:
        """Note every closure the coordinator puts back to run again (a worker died under it)."""
        cluster = getattr(self.coordinator, "_cluster", None)
        closures = getattr(cluster, "closure_queue", None)
        original = getattr(closures, "put_back", None)
        if original is None:
            raise PSTrainingError(
                f"this TensorFlow ({tf.__version__}) has no ClusterCoordinator closure queue to watch for re-run "
                "closures; streamrover's TF-PS trainer is tested with tensorflow-cpu 2.20"
            )

        def put_back(closure: Any) -> Any:
            self.reruns += 1
            self._reruns.set()
            log.warning("a closure is re-run (its worker failed): rolling back to the last checkpoint")
            return original(closure)

        closures.put_back = put_back  # type: ignore[union-attr]

    def _event(self, kind: str, **fields: Any) -> None:
        line = {"event": kind, "t": time.time(), "pid": os.getpid(), **fields}
        log.info("%s", line)
        if self.env.events:
            with open(self.env.events, "a") as f:
                f.write(json.dumps(line) + "\n")

    # -- restore --------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any]) -> str | None:
        """Load the newest checkpoint into ``state``'s variables and reset the shard service to its cursor.

        With no checkpoint yet, the cursor is reset to empty and the initial variables are
        checkpointed at step 0, so a rollback always has a checkpoint to go back to.
        """
        started = time.monotonic()
        self._state = state
        self._resumed_pending = True
        loaded = restore_before_lease(lambda: self.checkpointer.load(restore=True), self.client)  # trainers/api.py
        if loaded is None:
            self.step, self.restored_from = 0, None
            self._save()
            if self.exporter is not None:
                self.exporter.start(0)
            self._event("restore", source=None, step=0, seconds=time.monotonic() - started)
            return None
        load_variables_state(loaded.state["vars"], state)
        self._binder.last_cursor = loaded.cursor
        self.step = self._last_ckpt_step = loaded.step
        self.restored_from = f"{loaded.source.value}:{loaded.step}"
        if self.exporter is not None:  # versions above the resumed step retired; durable ones without a version
            self.exporter.start(self.step)
        self.timings["restore"] = time.monotonic() - started
        memory = self.checkpointer.engine.newest()
        self._event("restore", source=loaded.source.value, step=loaded.step, seconds=self.timings["restore"],
                    memory_step=memory.step if memory is not None else None)  # fmt: skip
        return self.restored_from

    def _rollback(self, why: str) -> None:
        started = time.monotonic()
        self.rollbacks += 1
        if self._feed is not None:
            self._feed.stop()
        self._reruns.clear()  # a closure put back from now on makes the next loop roll back again
        self._join(attempts=3)
        self._inflight.clear()
        self._unacked.clear()  # the restore resets the cursor: these positions are read again
        self._lease_lost, self._step_failed = False, None
        try:
            self.restore(self._state)
        except _PS_LOST as exc:  # the variables cannot be assigned: a parameter server is gone
            raise ParameterServerLostError(f"rollback failed: {exc}") from exc
        self._event("rollback", why=why, step=self.step, seconds=time.monotonic() - started)

    def _rollback_reason(self) -> str | None:
        if self._reruns.is_set():
            return "a closure was re-run"
        if self._lease_lost:
            return "a lease was lost under applied records"
        return self._step_failed

    def _join(self, attempts: int = 1) -> None:
        """Wait until no closure runs. A step's error is raised by the first join after it (then cleared):
        with ``attempts`` > 1 that many errors are tolerated (a rollback follows anyway)."""
        for attempt in range(attempts):
            try:
                self.coordinator.join()
                return
            except _PS_LOST as exc:
                if attempt == attempts - 1:
                    raise ParameterServerLostError(f"the cluster did not recover: {exc}") from exc
                self._step_failed = self._step_failed or f"join: {str(exc)[:300]}"

    # -- checkpoints ----------------------------------------------------------------------
    def _save(self, persist: bool = True) -> None:
        # no step since the last checkpoint or restore (acks of gaps, the end): one on, as checkpoints never change
        self.step = max(self.step, self._last_ckpt_step + 1)
        self.checkpointer.save(self.step, {"vars": variables_state(self._state)}, persist=persist)
        self._last_ckpt_step = self.step

    def checkpoint(self) -> bool:
        """Drain, ack, flush and save at the current step; False when it rolled back instead.

        Raises :class:`~streamrover.serving.api.ExportError` if an export failed since the last one."""
        if self.exporter is not None:
            self.exporter.check()  # a failed export stops the trainer (its restart exports what was missed)
        self._join(attempts=2)
        if self._reruns.is_set():
            self._rollback("a closure was re-run")
            return False
        while self._inflight:
            self._retire(self._inflight.popleft(), self._on_result)
        self._send_acks()
        why = self._rollback_reason()
        if why:
            self._rollback(why)
            return False
        try:
            self._save()  # rule 3 of trainers/api.py: the chief alone acks, and prepare_cut flushes its acks first
        except AckFailedError as exc:
            self._rollback(f"an ack was refused: {exc}")
            return False
        self._event("checkpoint", step=self.step, records=self._binder.last_cursor.size())
        return True

    # -- the loop -------------------------------------------------------------------------
    def _retire(self, done: _Step, on_result: Callable[[int, Any], None] | None = None) -> None:
        try:
            value = done.value.fetch()
        except _PS_LOST as exc:  # a worker failed under it (a PS failure too: then the rollback fails)
            self._step_failed = f"step {done.step} failed: {str(exc)[:300]}"
            return  # its records are not acked: the rollback hands them out again
        if self._resumed_pending:
            self._resumed_pending = False
            self._event("resumed", step=done.step)  # the first step completed after a (re)start or rollback
        for shard, end in done.acks:
            self._ack(shard, end, done.step)
        if on_result is not None and not self._reruns.is_set():
            on_result(done.step, value)

    def fit(
        self,
        step_fn: Callable[..., Any],
        state: Mapping[str, Any],
        *,
        dataset: str,
        batch_size: int = 256,
        columns: list[str] | None = None,
        stop_at_records: int | None = None,
        on_result: Callable[[int, Any], None] | None = None,
        idle_checkpoint: float = 2.0,
        exit_on_ps_loss: bool = True,
    ) -> FitResult:
        """Train ``step_fn(batch: dict[str, tf.Tensor])`` on ``dataset`` until it ends (or a checkpoint's cursor
        holds ``stop_at_records`` positions, or SIGTERM). ``state``: the ``tf.Module`` s whose variables are
        checkpointed (model, optimizer, ledger). ``on_result(step, fetched)`` sees each step's result.

        A lost parameter server ends the process with :data:`EXIT_RESTART` (``exit_on_ps_loss``): the
        launcher restarts the servers and this script, which restores.
        """
        try:
            return self._fit(step_fn, state, dataset, batch_size, columns, stop_at_records, on_result, idle_checkpoint)
        except ParameterServerLostError as exc:
            if not exit_on_ps_loss:
                raise
            self._event("ps_lost", error=str(exc)[:500])
            logging.shutdown()
            os._exit(EXIT_RESTART)

    def _fit(
        self,
        step_fn: Callable[..., Any],
        state: Mapping[str, Any],
        dataset: str,
        batch_size: int,
        columns: list[str] | None,
        stop_at_records: int | None,
        on_result: Callable[[int, Any], None] | None,
        idle_checkpoint: float,
    ) -> FitResult:
        fn = tf.function(step_fn, reduce_retracing=True)
        self._on_result = on_result
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self.restore(state)

            def new_feed() -> LeaseFeed:
                return LeaseFeed(self.client, dataset, batch_size, columns=columns).start()

            self._feed = new_feed()
            stopped = False
            done = self._reached(stop_at_records)  # a chief restarted after the end: nothing left to do
            while not done:
                why = self._rollback_reason()
                if why:
                    self._rollback(why)
                    self._feed = new_feed()
                    continue
                if self._stop_requested:
                    stopped = done = self._drain_and_checkpoint(new_feed)
                    continue
                item = self._feed.get(timeout=idle_checkpoint)
                if item is END:
                    done = self._drain_and_checkpoint(new_feed)
                    continue
                if item is IDLE:
                    if self.step != self._last_ckpt_step or self._inflight:
                        if self._drain_and_checkpoint(new_feed):
                            done = self._reached(stop_at_records)
                    continue
                assert isinstance(item, Batch)
                if item.rows == 0:  # positions only (a tail of gaps): ack with the newest step
                    if self._inflight:
                        self._inflight[-1].acks.append((item.shard, item.end))
                    else:
                        self._ack_now(item)
                    continue
                self.step += 1
                tensors = {k: tf.convert_to_tensor(v) for k, v in item.columns.items()}
                try:
                    value = self.coordinator.schedule(fn, args=(tensors,))
                except _PS_LOST as exc:  # an earlier step's error, raised here: roll back (this batch is re-read)
                    self._step_failed = f"schedule: {str(exc)[:300]}"
                    continue
                self._inflight.append(_Step(self.step, value, [(item.shard, item.end)]))
                while len(self._inflight) > self.max_inflight:
                    self._retire(self._inflight.popleft(), on_result)
                if self.ckpt_every and self.step % self.ckpt_every == 0:
                    if self._drain_and_checkpoint(new_feed):
                        done = self._reached(stop_at_records)
            self.checkpointer.wait(timeout=300)
            self._event("done", step=self.step, records=self._binder.last_cursor.size(), stopped=stopped)
            return FitResult(self.step, self._binder.last_cursor.size(), self.rollbacks, self.restored_from, stopped)
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._feed is not None:
                self._feed.stop()

    def _drain_and_checkpoint(self, new_feed: Callable[[], LeaseFeed]) -> bool:
        if self.checkpoint():
            return True
        self._feed = new_feed()  # rolled back: read again from the restored cursor
        return False

    def _reached(self, stop_at_records: int | None) -> bool:
        return stop_at_records is not None and self._binder.last_cursor.size() >= stop_at_records

    def _ack(self, shard: LeasedShard, end: int, step: int) -> None:
        """Ack ``end`` of ``shard`` (applied at ``step``). Progress inside a shard is coalesced until the next
        checkpoint (every cut follows a drain, so only the newest position per shard matters); the end of a
        shard is acked at once (the master then hands its lease on)."""
        self._unacked[shard.shard_id] = (shard, end, step)
        if end >= shard.lease.end:
            self._send_acks([shard.shard_id])

    def _send_acks(self, shard_ids: list[str] | None = None) -> None:
        for shard_id in list(self._unacked) if shard_ids is None else shard_ids:
            shard, end, step = self._unacked.pop(shard_id)
            try:
                shard.ack(end, step=step, wait=False)
            except LeaseLostError:
                self._lease_lost = True

    def _ack_now(self, item: Batch) -> None:
        self._ack(item.shard, item.end, self.step)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._stop_requested = True

    def close(self) -> None:
        """Leave the shard service; the checkpoints stay (shared memory for a restarted chief, storage)."""
        self.checkpointer.close()
        if self.exporter is not None:
            self.exporter.close()  # every durable checkpoint handed to it is exported (or its failure raised)
        self.client.leave()
        self.client.close()
