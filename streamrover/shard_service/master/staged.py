"""Staged datasets in the core: files a sink commits become partitions and shards, once per key.

A commit is keyed by (dataset, producer, part, epoch): a Flink job, subtask and checkpoint
id, or a Spark query, "driver" and batch id. The first commit of a key adds one partition per
non-empty file (its id the file's URI, positions its rows) and plans its shards, all in one
journal transaction with the key's row; a later commit of the key changes nothing and says
so. Files are checked (:func:`streamrover.sources.staged.inspect_file`) before they get here,
outside the service lock; the checks that need the dataset's state are made here.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrover.shard_service.api import FailedPreconditionError, InvalidArgumentError, PartitionPlan
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.planner import plan_epoch
from streamrover.shard_service.master.state import CoreState
from streamrover.shard_service.master.streams import StreamPlanner
from streamrover.sources.staged import STAGING_DIR, FileFacts, in_staging, is_staged, retention


@dataclass(frozen=True)
class StagedOutcome:
    """What a commit did: ``already`` when the key was committed before (then nothing changed)."""

    already: bool
    records: int
    #: the (producer, part)'s staging dir, its committed files of epochs <= this one, for garbage collection
    staging_dir: str = ""
    keep: tuple[str, ...] = ()


class StagedCommits:
    """Staged commits, a part of the core (``ShardCore.staged``): its own state is the committed keys with
    their records and files (journalled); it adds partitions and shards through the shard table."""

    def __init__(self, table: CoreState, streams: StreamPlanner) -> None:
        self.table = table
        self.streams = streams  # the committed positions (retention), the ends (a staged file's rows)
        self.available = streams.available  # (dataset, partition index) -> end
        self.retired_staged: set[tuple[str, str]] = set()  # (dataset, file uri) handed to retention (memory only)
        # (dataset, producer, part, epoch) -> (records, file URIs) of each commit
        self.staged_commits: dict[tuple[str, str, str, int], tuple[int, list[str]]] = {}
        for dataset, producer, part, epoch, records, files in table.journal.load_staged():
            self.staged_commits[(dataset, producer, part, epoch)] = (records, files)

    def forget_dataset(self, name: str) -> None:
        """Forget the commits of dataset ``name`` (it was removed; its journal rows with it)."""
        for staged in [k for k in self.staged_commits if k[0] == name]:
            del self.staged_commits[staged]
        self.retired_staged = {k for k in self.retired_staged if k[0] != name}

    def staged_dataset(self, name: str) -> DatasetRecord:
        """The dataset ``name``, which must be a staged one (NOT_FOUND, else FAILED_PRECONDITION)."""
        ds = self.table.dataset(name)
        if not is_staged(ds.spec.uri):
            raise FailedPreconditionError(
                f"dataset {name!r} is not a staged dataset (its uri is {ds.spec.uri!r}); "
                "register one with uri staged://<name> to commit files to it"
            )
        return ds

    def staged_commit(self, name: str, producer: str, part: str, epoch: int) -> StagedOutcome | None:
        """The outcome of an earlier commit of the key, None when the key is not committed."""
        ds = self.staged_dataset(name)
        found = self.staged_commits.get((name, producer, part, epoch))
        if found is None:
            return None
        return StagedOutcome(True, found[0], *self._garbage_scope(ds, producer, part, epoch))

    def _garbage_scope(self, ds: DatasetRecord, producer: str, part: str, epoch: int) -> tuple[str, tuple[str, ...]]:
        staging = ds.spec.options.get(STAGING_DIR, "")
        if not staging:
            return "", ()
        keep = [
            f
            for (d, p, k, e), (_, files) in self.staged_commits.items()
            if d == ds.name and p == producer and k == part and e <= epoch
            for f in files
        ]
        return staging, tuple(keep)

    def trained_staged_files(self) -> dict[str, list[str]]:
        """Per staging dir: committed files retention may delete now (see ``sr.staged_retention``).

        A file qualifies when the limit offsets are committed upstream by (the committed cursor, no further
        than the previous durable checkpoint's) covers every one of its rows. Each is returned once per master
        run (:attr:`retired_staged`); one whose deletion failed is not retried before the master restarts.
        """
        out: dict[str, list[str]] = {}
        for ds in self.table.datasets.values():
            staging = ds.spec.options.get(STAGING_DIR, "")
            if not staging or not is_staged(ds.spec.uri) or retention(ds.spec.options) != "delete":
                continue
            todo = [p for p in ds.partitions if (ds.name, p.id) not in self.retired_staged]
            if not todo:
                continue
            done = self.streams.committed_positions(ds)
            for plan in todo:
                if done.get(plan.id, 0) >= plan.end:
                    self.retired_staged.add((ds.name, plan.id))
                    if in_staging(staging, plan.id):
                        out.setdefault(staging, []).append(plan.id)
        return out

    def commit_staged(self, name: str, producer: str, part: str, epoch: int, files: list[FileFacts]) -> StagedOutcome:
        """Commit the checked ``files`` under the key, or answer that the key was committed before."""
        earlier = self.staged_commit(name, producer, part, epoch)
        if earlier is not None:
            return earlier
        ds = self.staged_dataset(name)
        self.table.check_usable(ds)
        known = ds.partition_by_id()
        schema = ds.schema_json if ds.schema_json not in ("", "[]") else ""
        for f in files:
            if f.uri in known:
                raise InvalidArgumentError(
                    f"staged file {f.uri!r} is already committed to dataset {name!r}: stage each commit's files anew"
                )
            if not schema and f.rows:
                schema = f.schema_json
            if f.rows and f.schema_json != schema:
                raise InvalidArgumentError(
                    f"staged file {f.uri!r} has schema {f.schema_json}, but dataset {name!r} has {schema}"
                )
        plans = []
        for f in files:
            if f.rows:
                plans.append(PartitionPlan(len(ds.partitions), f.uri, 0, f.rows))
                ds.partitions.append(plans[-1])
                self.available[(name, plans[-1].index)] = f.rows
        if schema:
            ds.schema_json = schema
        records = sum(f.rows for f in files)
        uris = [f.uri for f in files]
        self.staged_commits[(name, producer, part, epoch)] = (records, uris)
        with self.table.journal.transaction():
            self.table.add_planned(ds, plan_epoch(plans, 0, ds.shard_size, False, 0))
            self.table.journal.put_dataset(ds)
            self.table.journal.put_staged(name, producer, part, epoch, records, uris)
            self.table.save_counters()
        return StagedOutcome(False, records, *self._garbage_scope(ds, producer, part, epoch))
