"""``FlashRun``: one rank's flash checkpoints inside a framework's own training loop (Lightning, HF Trainer).

The framework owns the loop, the optimizer and its own checkpoint format; this is what its
callbacks call so that its state goes through :class:`~streamrover.ckpt.Checkpointer` (shared
memory in the time of a copy, persisted asynchronously by the saver that ``dlrover-run``'s agent
hosts, or one started on demand) and, when a streamrover dataset feeds the loop, so that the
trainer contract of :mod:`streamrover.trainers.api` holds:

1. :meth:`restore` (every rank, before the first batch is read): rank 0 loads the newest
   checkpoint (shared memory when it is at least as new as storage) and resets the shard
   service to its cursor, or to the empty cursor when there is none; the state goes to the
   other ranks by one broadcast, then a barrier: no rank leases before the reset.
2. :meth:`step_done` (every rank, after each optimizer step): acks what the datasets yielded
   for that step, tagged with the framework's global step; returns whether a checkpoint is due.
3. :meth:`save` (every rank, when due): each rank flushes its acks, a barrier, then rank 0
   snapshots the state (``prepare_cut`` of the step inside the save; one copy, the state is the
   same on every rank) and the saver persists every ``persist_every``-th snapshot.
4. The cut is committed by the saver once the manifest is durable; :meth:`close` takes a last,
   durable checkpoint (and a confirming one, as :meth:`StreamSession.close` does).

Without a stream (no ``STREAMROVER_MASTER``, no ``master=``) there is no cut and no ack: the
same calls checkpoint the framework's state only. Imports torch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any, cast

import torch.distributed as dist
from torch.utils.data import IterableDataset

from streamrover.ckpt import (
    Checkpointer,
    CursorBinder,
    LoadedCheckpoint,
    LoadedFrom,
    NoCheckpointError,
    RetentionPolicy,
)
from streamrover.ckpt.torch_adapter import _clone_tensors
from streamrover.cursor import DataCursor
from streamrover.shard_service import LeaseLostError, ShardClient
from streamrover.trainers.api import flush_before_cut, restore_before_lease
from streamrover.trainers.torch import env
from streamrover.trainers.torch.dataset import StreamDataset, StreamStateLostError
from streamrover.trainers.torch.session import broadcast_state

log = logging.getLogger(__name__)
DEFAULT_EVERY = 50


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class TrainedOnly(IterableDataset):
    """A :class:`StreamDataset` acked only up to the batches the loop has trained on.

    Frameworks read ahead: Lightning's fetcher and accelerate's loader hold the next batch before the
    current one is trained (to know which batch is the last). :meth:`StreamDataset.step_done` acks
    everything yielded, so a cut would hold a read-ahead batch that is not in the model. Here each
    yielded batch keeps the positions it advanced; :meth:`batch_trained` (one call per trained batch, in
    order) marks the oldest as trained, and :meth:`step_done` acks only those.

    The inner dataset needs an ``idle_timeout``: the shard service says a bounded dataset has ended
    only once every record is acked, and the read-ahead asks for the next batch before the last one
    is trained (so acked); an idle stream yields an *empty* batch (zero rows) after ``idle_timeout``,
    which lets the loop train the last batch. Iteration stops at the first empty batch after the end.
    The training step must accept empty batches (Lightning on one device: return None to skip it).
    """

    def __init__(self, inner: StreamDataset) -> None:
        super().__init__()
        if inner.idle_timeout is None:
            raise ValueError("a stream read ahead by the framework needs idle_timeout (seconds), see TrainedOnly")
        self.inner = inner
        self._yielded: deque[dict[str, tuple[Any, int]]] = deque()  # per yielded, untrained batch: its marks
        self._trained: dict[str, tuple[Any, int]] = {}

    @property
    def ended(self) -> bool:
        return self.inner.ended

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._yielded.clear()  # a new iterator: read-ahead batches of the previous one were never trained
        seen: dict[str, tuple[Any, int]] = {}
        for batch in self.inner:
            with self.inner._lock:
                pending = dict(self.inner._pending)
            marks = {sid: mark for sid, mark in pending.items() if seen.get(sid) != mark}
            if self.inner.ended and not marks and not any(len(v) for v in batch.values()):
                return  # the dataset ended and every yielded batch was read: the epoch is over
            self._yielded.append(marks)
            seen = pending
            yield batch

    def batch_trained(self) -> None:
        if self._yielded:
            self._trained.update(self._yielded.popleft())

    def step_done(self, step: int) -> int:
        """Ack, with ``step``, the positions of the batches trained since the last call; returns the shards acked."""
        trained, self._trained = self._trained, {}
        for shard, end in trained.values():
            try:
                shard.ack(end, step=step, wait=False)
            except LeaseLostError as exc:
                raise StreamStateLostError(
                    f"shard {shard.shard_id}: records up to {end} were applied at step {step} but the lease is gone "
                    f"({exc}); restart from the last checkpoint"
                ) from exc
        with self.inner._lock:  # what is acked here no longer waits in the inner dataset's pending set
            for sid, (_, end) in trained.items():
                current = self.inner._pending.get(sid)
                if current is not None and current[1] <= end:
                    del self.inner._pending[sid]
        return len(trained)


class FlashRun:
    """Flash checkpoints (and stream acks) of one rank of a framework-driven loop; see the module docstring.

    Args:
        every_n_steps: global steps between snapshots (default ``STREAMROVER_CKPT_EVERY``, else 50).
        persist_every: persist every n-th snapshot to storage (1: all); the others live in shared memory
            only (a restart on the same node resumes from them, a lost node from the last persisted one).
        ckpt_dir: checkpoint root (default ``STREAMROVER_CKPT_DIR``, which ``dlrover-run --ckpt-dir`` sets).
        master, token: the shard service (default ``STREAMROVER_MASTER``/``_TOKEN``); None: no stream.
        keep_last: checkpoints kept on storage (default ``STREAMROVER_CKPT_KEEP``, else 3).
        stream: False: never join a shard service (the loop reads no stream; snapshots carry no cut).
    """

    def __init__(
        self,
        *,
        every_n_steps: int | None = None,
        persist_every: int = 1,
        ckpt_dir: str | None = None,
        master: str | None = None,
        token: str | None = None,
        keep_last: int | None = None,
        stream: bool = True,
    ) -> None:
        cfg = env.from_env()
        self.every = every_n_steps if every_n_steps is not None else (cfg.ckpt_every or DEFAULT_EVERY)
        if self.every < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {self.every}")
        if persist_every < 1:
            raise ValueError(f"persist_every must be >= 1, got {persist_every}")
        self.persist_every = persist_every
        root = ckpt_dir or cfg.ckpt_dir
        if not root:
            raise ValueError("no checkpoint location: run under dlrover-run --ckpt-dir URL, or pass ckpt_dir=")
        self.root = root
        self._cfg = cfg
        self._keep = keep_last or cfg.ckpt_keep or 3
        address = (master or cfg.master) if stream else None
        self.client: ShardClient | None = None
        if address:
            self.client = ShardClient(address, token=cfg.token if token is None else token, name=f"flash@{cfg.node_id}")
            self.client.join()
        self.datasets: list[TrainedOnly] = []
        self.checkpointer: Checkpointer | None = None
        self.rank = 0
        self.restored_from: str | None = None  # "memory:STEP" / "storage:STEP" / None (a fresh start)
        self.last_saved: int | None = None
        self.last_persisted: int | None = None
        self._saves = 0
        self._acked_step = 0

    # -- start -------------------------------------------------------------------------------
    def open(self, rank: int) -> None:
        """Create rank 0's checkpointer (idempotent); other ranks hold none."""
        self.rank = rank
        if rank != 0 or self.checkpointer is not None:
            return
        cfg = self._cfg
        self.checkpointer = Checkpointer(
            self.root,
            rank=0,
            world_size=1,  # one copy: the state is the same on every rank; the cut is global
            binder=cast(CursorBinder, self.client) if self.client is not None else None,
            retention=RetentionPolicy(keep_last=self._keep),
            saver=cfg.saver if cfg.ckpt_job else "auto",
            job=cfg.ckpt_job,
        )

    def dataset(self, name: str, batch_size: int = 256, **kwargs: Any) -> TrainedOnly:
        """A stream dataset of ``name`` whose batches are acked once trained (``DataLoader(ds, batch_size=None)``)."""
        if self.client is None:
            raise ValueError("no shard service: run under dlrover-run --shard-service HOST:PORT, or pass master=")
        kwargs.setdefault("idle_timeout", 1.0)  # see TrainedOnly
        ds = TrainedOnly(StreamDataset(self.client, name, batch_size, **kwargs))
        self.datasets.append(ds)
        return ds

    def batch_trained(self) -> None:
        """The loop has trained on (run forward and backward over) the oldest batch not yet reported."""
        for ds in self.datasets:
            ds.batch_trained()

    def restore(self, zero_copy: bool = False) -> LoadedCheckpoint | None:
        """Rule 1 on every rank: the newest checkpoint, or None; a collective. Its state is a fresh copy, or with
        ``zero_copy`` on rank 0 views of shared memory where it came from there (valid until the next save: the
        caller copies out what it keeps; a restore then skips a private copy of the whole state)."""
        loaded: LoadedCheckpoint | None = None
        if self.checkpointer is not None:
            ckpt = self.checkpointer
            if self.client is not None:
                loaded = restore_before_lease(lambda: ckpt.load(zero_copy=zero_copy, restore=True), self.client)
            else:
                try:
                    loaded = ckpt.load(zero_copy=zero_copy)
                except NoCheckpointError:
                    loaded = None
        if _distributed():
            meta = {"step": loaded.step, "from": loaded.source.value} if loaded is not None else None
            meta_all, state = broadcast_state({"loaded": meta}, loaded.state if loaded is not None else {})
            if self.rank != 0 and meta_all["loaded"] is not None:
                info = meta_all["loaded"]
                loaded = LoadedCheckpoint(
                    int(info["step"]), _clone_tensors(state), DataCursor(), LoadedFrom(info["from"])
                )
            dist.barrier()
        if loaded is not None:
            self.restored_from = f"{loaded.source.value}:{loaded.step}"
            self.last_saved = self._acked_step = loaded.step
            if loaded.source == LoadedFrom.STORAGE:  # durable: never persisted a second time
                self.last_persisted = loaded.step
        log.warning("streamrover flash checkpoint: rank %d resumes %s", self.rank,
                    f"at step {loaded.step} from {loaded.source.value}" if loaded else "from scratch")  # fmt: skip
        return loaded

    # -- per step ------------------------------------------------------------------------------
    def step_done(self, step: int) -> bool:
        """After the optimizer step numbered ``step``: ack the batches trained (:meth:`batch_trained`) since the
        previous step; True when a snapshot is due now."""
        if step <= self._acked_step:  # no optimizer step since (gradient accumulation): nothing to ack
            return False
        self._acked_step = step
        for ds in self.datasets:
            ds.step_done(step)
        return step % self.every == 0 and step != self.last_saved

    def flush(self) -> None:
        """Rule 3 on every rank: this rank's acks are recorded, then a barrier (a collective)."""
        if self.client is not None:
            flush_before_cut(
                self.client,
                lambda exc: StreamStateLostError(
                    f"rank {self.rank}: acks of applied records were refused ({exc}); restart from the last checkpoint"
                ),
            )
        if _distributed():
            dist.barrier()

    def save(self, step: int, state: Any, *, persist: bool | None = None, flushed: bool = False) -> None:
        """Snapshot ``state`` (rank 0's; other ranks pass anything) at ``step``; a collective unless ``flushed``."""
        if not flushed:
            self.flush()
        self.last_saved = step
        if self.checkpointer is None:
            return
        self._saves += 1
        if persist is None:
            persist = self._saves % self.persist_every == 0
        if persist and step == self.last_persisted:
            # durable already (Lightning's own checkpoint callback at the same global step): this snapshot goes to
            # shared memory only, since a durable checkpoint's files never change once written
            persist = False
        self.checkpointer.save(step, state, persist=persist)
        if persist:
            self.last_persisted = step

    def close(self, step: int | None = None, state: Any = None) -> None:
        """End of training: with ``step``, a last durable checkpoint (and a confirming one with a stream), then
        leave the shard service. A collective."""
        try:
            if step is not None:
                if step != self.last_persisted:
                    self.save(step, state, persist=True)
                if self.checkpointer is not None:
                    self.checkpointer.wait(timeout=300)
                    if self.client is not None:  # upstream commits lag by one checkpoint: confirm the final cursor
                        self.checkpointer.save(step + 1, state, persist=True)
                        self.checkpointer.wait(timeout=300)
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()
                self.checkpointer = None
            if self.client is not None:
                if _distributed():
                    dist.barrier()
                self.client.leave()
                self.client.close()
                self.client = None
