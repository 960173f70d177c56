"""Registering and removing datasets (the shard service core's dataset operations)."""

from __future__ import annotations

from streamrover.cursor import DataCursor
from streamrover.shard_service.api import (
    AlreadyExistsError,
    DatasetSpec,
    InvalidArgumentError,
    PartitionPlan,
    ShardState,
)
from streamrover.shard_service.bookkeeping import DatasetRecord
from streamrover.shard_service.planner import plan_epoch
from streamrover.shard_service.streams import StreamOps
from streamrover.sources.api import Partition, SourceKind


def without_dataset(cursor: DataCursor, name: str) -> DataCursor:
    """``cursor`` less every entry of dataset ``name``."""
    return DataCursor({k: v for k, v in cursor.items() if k.dataset != name})


class DatasetOps(StreamOps):
    """The core's dataset operations: register (planning the first epoch or the first poll) and remove."""

    def register_dataset(
        self, spec: DatasetSpec, kind: SourceKind, partitions: list[Partition], schema_json: str
    ) -> tuple[DatasetRecord, bool]:
        """Register a dataset; returns (its record, whether it was created).

        Idempotent for the same spec; :class:`AlreadyExistsError` for the same name with another spec,
        :class:`InvalidArgumentError` for epochs or shuffle on a stream.
        """
        spec = spec.normalized()
        existing = self.datasets.get(spec.name)
        if existing is not None:
            if existing.spec == spec:
                return existing, False
            raise AlreadyExistsError(
                f"dataset {spec.name!r} is already registered with a different spec "
                f"({existing.spec.uri!r}); choose another name"
            )
        if kind is SourceKind.STREAM and (spec.epochs > 1 or spec.shuffle):
            raise InvalidArgumentError(
                f"dataset {spec.name!r} is a stream: epochs and shuffle apply to batch data only"
            )
        if kind is SourceKind.BATCH:
            plans = [PartitionPlan(i, p.id, p.start, p.end) for i, p in enumerate(partitions)]
        else:  # a stream's planned extent starts empty; the first poll plans what is there
            plans = [PartitionPlan(i, p.id, p.start, p.start) for i, p in enumerate(partitions)]
        ds = DatasetRecord(spec, kind, plans, schema_json, epochs_planned=0)
        self.datasets[ds.name] = ds
        self._new_dataset_indexes(ds.name)
        with self.journal.transaction():
            self.journal.delete_runs_of(ds.name)  # left by a removed dataset of that name, if any
            if kind is SourceKind.BATCH:
                self._plan_next_epoch(ds)
            else:
                ds.epochs_planned = 1
            self.journal.put_dataset(ds)
            self._save_counters()
        if kind is SourceKind.STREAM:
            self.extend_stream(ds.name, partitions)
        return ds, True

    def _plan_next_epoch(self, ds: DatasetRecord) -> None:
        epoch = ds.epochs_planned
        ds.epochs_planned += 1
        spec = ds.spec
        self._add_planned(ds, plan_epoch(ds.partitions, epoch, ds.shard_size, spec.shuffle, spec.seed))
        self.journal.put_dataset(ds)

    def remove_dataset(self, name: str) -> tuple[int, int]:
        """Forget dataset ``name``: revoke its leases, delete its shards, cursor entries and row in one transaction.

        Returns (leases revoked, shards removed). Workers learn of the revoked leases at their next
        heartbeat; acks of the removed shards are refused from now on (their attempts are never issued
        again: a dataset registered later under the same name gets new attempt numbers).
        """
        self.dataset(name)
        sids = sorted(self.by_dataset[name])
        revoked = 0
        with self.journal.transaction():
            for sid in sids:
                s = self.shards[sid]
                if s.state is ShardState.LEASED:
                    w = self.workers.get(s.worker or "")
                    if w is not None:
                        w.leases.discard(sid)
                        w.revoked.add((sid, s.attempt))
                    revoked += 1
                self._drop_shard(sid)
            self.journal.delete_shards_of(name)
            self.journal.delete_dataset(name)
            self.journal.delete_runs_of(name)
            self.journal.delete_staged_of(name)
            if name in self.committed.datasets():
                self.committed = without_dataset(self.committed, name)
                self.journal.put_cursor(self.committed)
            if name in self.durable.datasets():
                self.durable = without_dataset(self.durable, name)
                self.journal.put_meta("durable_cursor", self.durable.to_json())
            for cut in self.cuts.values():  # a cut committed later must not bring the dataset back
                if name in cut.cursor.datasets():
                    cut.cursor = without_dataset(cut.cursor, name)
                    self.journal.put_cut(cut)
            self._save_counters()
        del self.datasets[name]
        for index in (self.by_dataset, self.queues, self.state_counts):
            index.pop(name, None)
        for key in [k for k in self.tails if k[1] == name]:
            del self.tails[key]
        for keyed in (self.available, self.pending_since):
            for pkey in [k for k in keyed if k[0] == name]:
                del keyed[pkey]
        self.source_errors.pop(name, None)
        for staged in [k for k in self.staged_commits if k[0] == name]:
            del self.staged_commits[staged]
        self.retired_staged = {k for k in self.retired_staged if k[0] != name}
        self.restore_revoked.difference_update(sids)
        return revoked, len(sids)
