"""Staged datasets in the core: files a sink commits become partitions and shards, once per key.

A commit is keyed by (dataset, producer, part, epoch): a Flink job, subtask and checkpoint
id, or a Spark query, "driver" and batch id. The first commit of a key adds one partition per
non-empty file (its id the file's URI, positions its rows) and plans its shards, all in one
journal transaction with the key's row; a later commit of the key changes nothing and says
so. Files are checked (:func:`streamrover.sources.staged.inspect_file`) before they get here,
outside the service lock; the checks that need the dataset's state are made here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from streamrover.shard_service.api import FailedPreconditionError, InvalidArgumentError, PartitionPlan
from streamrover.shard_service.master.bookkeeping import COMPACTED, DatasetRecord
from streamrover.shard_service.master.gaps import CommitGaps, Gap
from streamrover.shard_service.master.planner import plan_epoch
from streamrover.shard_service.master.state import CoreState
from streamrover.shard_service.master.streams import StreamPlanner
from streamrover.sources.api import SourceError
from streamrover.sources.staged import STAGING_DIR, FileFacts, gap_bound_ms, in_staging, is_staged, retention

log = logging.getLogger(__name__)


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
        self.gaps = CommitGaps(table.journal, table.clock)  # commits a later one names, not arrived (gaps.py)

    def forget_dataset(self, name: str) -> None:
        """Forget the commits of dataset ``name`` (it was removed; its journal rows with it)."""
        for staged in [k for k in self.staged_commits if k[0] == name]:
            del self.staged_commits[staged]
        self.retired_staged = {k for k in self.retired_staged if k[0] != name}
        self.gaps.forget_dataset(name)

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

    def commit_staged(self, name: str, producer: str, part: str, epoch: int, files: list[FileFacts],
                      previous: int | None = None) -> StagedOutcome:  # fmt: skip
        """Commit the checked ``files`` under the key, or answer that the key was committed before.

        ``previous``: the epoch of the (producer, part)'s commit before this one, when the sink knows it; a gap
        opens when it is not committed (:mod:`.gaps`).
        """
        earlier = self.staged_commit(name, producer, part, epoch)
        if earlier is not None:
            return earlier
        ds = self.staged_dataset(name)
        self.table.check_usable(ds)
        known = ds.partition_by_id()
        schema = ds.schema_json if ds.schema_json not in ("", "[]") else ""
        for f in files:
            if f.uri == COMPACTED:
                raise InvalidArgumentError(f"staged file uri {COMPACTED!r} is reserved (compacted files' partition)")
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
            self.table.journal.put_staged(name, producer, part, epoch, records, uris, previous)
            self.gaps.committed(name, producer, part, epoch, previous, self.staged_commits.__contains__)
            self.table.save_counters()
        return StagedOutcome(False, records, *self._garbage_scope(ds, producer, part, epoch))

    # ------------------------------------------------------------ commit gaps (gaps.py)
    def gap_bound(self, name: str) -> float | None:
        """Seconds a gap of dataset ``name`` may stay open; None when its gaps are not checked now (failed)."""
        ds = self.table.datasets.get(name)
        if ds is None or ds.failed:
            return None
        try:
            return gap_bound_ms(ds.spec.options) / 1000.0
        except SourceError:  # refused at registration; a journal from before then: the default
            return gap_bound_ms({}) / 1000.0

    def next_gap_deadline(self) -> float | None:
        """When the next open gap passes its bound (for the reaper's timer)."""
        return self.gaps.next_deadline(self.gap_bound)

    def expire_gaps(self) -> list[Gap]:
        """Gaps past their bound fail their dataset (``sr.on_data_loss=fail``) or are skipped; returns them."""
        due = self.gaps.due(self.gap_bound)
        for gap in due:
            ds = self.table.dataset(gap.dataset)
            if ds.failed:
                continue  # an earlier gap of this check failed it
            bound_ms = int((self.gap_bound(ds.name) or 0) * 1000)
            if ds.spec.options.get("sr.on_data_loss", "fail") == "skip":
                with self.table.journal.transaction():
                    self.gaps.skip(gap)
                log.error("dataset %s: %s for %d ms (sr.commit_gap_ms): skipped, its records are not trained "
                          "(sr.on_data_loss=skip)", ds.name, gap.describe(), bound_ms)  # fmt: skip
                continue
            reason = (
                f"{gap.describe()}, for longer than sr.commit_gap_ms={bound_ms}: its records are lost unless the "
                f"sink commits it. Commit it (restart the Flink job from a checkpoint that holds it) and run "
                f"'streamrover dataset resume {ds.name}' (one more sr.commit_gap_ms to arrive), or resume with "
                "--skip-lost to account the missing commit as skipped (or register with sr.on_data_loss=skip)"
            )
            log.error("dataset %s failed: %s", ds.name, reason)
            self.streams.fail_dataset(ds.name, reason)
        return due

    def resume_gaps(self, name: str, skip: bool) -> int:
        """Dataset ``name`` was resumed: its open gaps get one more bound, or are skipped (``skip``)."""
        with self.table.journal.transaction():
            return self.gaps.restart(name, skip)
