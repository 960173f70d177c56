"""Compaction of a staged dataset's files: history costs nothing per committed file (issue 32).

A staged dataset gains a partition per committed file (``staged.py``). Once a file's records are in the committed
cursor and in both durable limits (no restore this master accepts can need them: the rule staged retention
deletes by), and retention has had it, the file is compacted: its partition is no longer held
(:class:`~.bookkeeping.PartitionPlans`), its cursor entry joins the dataset's :data:`~.bookkeeping.COMPACTED`
partition, whose positions are the compacted files' records in commit order, one interval ``[0, records)``, and
its commit row forgets its uri (with ``sr.staged_retention=delete``: the staging collector need not keep it). Files
compact in partition order only (a prefix), so a cursor's compacted interval always names the same files.

A cursor from before a compaction (a checkpoint manifest) names compacted files one by one: :func:`expand`
turns it into the compacted form when it holds every compacted record, and refuses it otherwise (the files are
forgotten, and deleted by retention: their records cannot be read again). Records accounted lost stop compaction
at their file (the compacted interval holds trained records only).
"""

from __future__ import annotations

from collections.abc import Mapping

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import FailedPreconditionError, PartitionPlan
from streamrover.shard_service.master.bookkeeping import COMPACTED, DatasetRecord
from streamrover.shard_service.master.staged import StagedCommits
from streamrover.sources.staged import STAGING_DIR, in_staging, is_staged, retention


def compact(staged: StagedCommits) -> int:
    """Compact every staged dataset's files that no restore can need (in one journal transaction each).
    Returns how many files were compacted."""
    table, book = staged.table, staged.streams.cut_book
    total = 0
    for ds in list(table.datasets.values()):
        if not is_staged(ds.spec.uri) or ds.failed:
            continue
        staging = ds.spec.options.get(STAGING_DIR, "")
        deleting = bool(staging) and retention(ds.spec.options) == "delete"
        cursors = (book.committed, book.durable, book.upstream)
        n = 0
        for plan in ds.partitions:
            key = PartitionKey(ds.name, 0, plan.id)
            if not all(c.get(key).covers(plan.start, plan.end) for c in cursors):
                break
            if deleting and in_staging(staging, plan.id) and (ds.name, plan.id) not in staged.retired_staged:
                break  # retention has not had it yet: it lists live partitions only
            if table.reading.get((ds.name, 0, plan.index)):
                break
            n += 1
        if n:
            total += _compact(staged, ds, n, forget_uris=deleting or not staging)
    return total


def _compact(staged: StagedCommits, ds: DatasetRecord, n: int, forget_uris: bool) -> int:
    book, journal = staged.streams.cut_book, staged.table.journal
    gone = ds.plans.compact(n)
    ids = {p.id for p in gone}
    before = ds.compacted_records
    ds.compacted_records += sum(p.end - p.start for p in gone)
    for p in gone:
        staged.available.pop((ds.name, p.index), None)
        staged.streams.holds.pop((ds.name, p.index), None)
        ds.runs.pop(p.index, None)
        staged.retired_staged.discard((ds.name, p.id))
    with journal.transaction():
        journal.put_dataset(ds)
        journal.put_compacted(ds)
        book.committed = fold_compacted(book.committed, ds, gone, before)
        journal.put_cursor(book.committed)
        book.durable = fold_compacted(book.durable, ds, gone, before)
        book.upstream = fold_compacted(book.upstream, ds, gone, before)
        journal.put_meta("durable_cursor", book.durable.to_json())
        journal.put_meta("upstream_cursor", book.upstream.to_json())
        for cut in book.cuts.values():
            folded = fold_compacted(cut.cursor, ds, gone, before)
            if folded is not cut.cursor:
                cut.cursor = folded
                journal.put_cut(cut)
        if forget_uris:
            for key, (records, files) in list(staged.staged_commits.items()):
                if key[0] == ds.name and files and ids.intersection(files):
                    kept = [f for f in files if f not in ids]
                    staged.staged_commits[key] = (records, kept)
                    journal.put_staged_files(*key, kept)
    return n


def fold_compacted(cursor: DataCursor, ds: DatasetRecord, gone: list[PartitionPlan], before: int) -> DataCursor:
    """``cursor`` with the entries of ``ds``'s files ``gone`` (just compacted; ``before``: the records compacted
    before them) replaced by its compacted interval, when it holds all of them and the compacted ones before (an
    older cut may not: it is left as it is, and :func:`expand` judges it if it is ever restored)."""
    keys = {PartitionKey(ds.name, 0, p.id): p for p in gone}
    had = cursor.get(PartitionKey(ds.name, 0, COMPACTED))
    if had != IntervalSet([(0, before)] if before else []):
        return cursor
    if not all(cursor.get(k).covers(p.start, p.end) for k, p in keys.items()):
        return cursor
    entries = {k: v for k, v in cursor.items() if k not in keys}
    entries[PartitionKey(ds.name, 0, COMPACTED)] = IntervalSet([(0, ds.compacted_records)])
    return DataCursor(entries, dict(cursor.lost_items()))


def expand(cursor: DataCursor, datasets: Mapping[str, DatasetRecord]) -> DataCursor:
    """``cursor`` in the compacted form of every staged dataset with compacted files, for a restore: entries of
    files no longer held are counted into the compacted interval. FailedPreconditionError when it does not hold
    exactly the compacted records (they can no longer be read again)."""
    out = cursor
    for ds in datasets.values():
        if not ds.compacted_records:
            continue
        held = ds.partition_by_id()
        compacted = PartitionKey(ds.name, 0, COMPACTED)
        forgotten = [k for k in out.only(ds.name).keys() if k.partition not in held and k != compacted]
        had = out.get(compacted)
        records = had.prefix_end(0) if had else 0
        if had and had.size() != records:
            records = -1  # not one interval from 0: not a compacted range this master made
        records += sum(out.get(k).size() for k in forgotten)
        if records != ds.compacted_records or any(k.epoch for k in forgotten):
            raise FailedPreconditionError(
                f"cannot restore: dataset {ds.name!r} compacted its first {ds.compacted_records} records (files "
                f"trained and committed by two durable checkpoints, then deleted by retention), and the cursor holds "
                f"{max(records, 0)} of them: restore from a newer checkpoint (one taken after those files were "
                "committed), or remove and register the dataset again to start it over"
            )
        if forgotten or not had:
            drop = set(forgotten)
            entries = {k: v for k, v in out.items() if k not in drop}
            entries[compacted] = IntervalSet([(0, ds.compacted_records)])
            out = DataCursor(entries, dict(out.lost_items()))
    return out


__all__ = ["compact", "expand", "fold_compacted"]
