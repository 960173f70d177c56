"""Small shards merged at lease time: a reader that gets through shards quickly is granted them as fewer, bigger ones.

Small planned shards are what relieves stragglers and bounds the work redone after a failure,
but each lease and each ack costs the master and the worker the same whatever the shard's size.
A lease request that carries ``merge_records`` (:meth:`ShardClient.shards` sends about
:data:`~streamrover.shard_service.client.pacing.MERGE_SECONDS` of its reader's work) lets the master grant
a run of planned shards as one: the shard it was about to grant and the never-leased TODO
shards that follow it in the same partition and epoch, up to ``merge_records`` records and the
number of shards the request may still take (each planned shard counts as one; far from the end of a
pass the last merge may run on to the records limit: :func:`merge_room`). The members'
journal rows are replaced by the merged shard's row in the lease's transaction; from then on it
is a shard like any other: its id names its coordinates (:func:`shard_id_for`), it is leased,
fenced, acked, expired and returned as one, and it never merges again.

Only shards never leased merge (attempt 0, nothing acked): no lease of a member was ever
issued, so no ack of one can arrive, and fencing has nothing to translate. Only batch datasets
that are not shuffled: a shuffled dataset asked for its shards in random order, and a stream's
planner extends its newest shards as offsets arrive. The guided end of a pass
(:meth:`CoreState.share`) still counts planned shards, so merged grants shrink as the end nears.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrover.shard_service.api import ShardState, shard_id_for
from streamrover.shard_service.master.bookkeeping import DatasetRecord, ShardRecord, WorkerRecord
from streamrover.sources.api import SourceKind

if TYPE_CHECKING:
    from streamrover.shard_service.master.state import CoreState


def _fresh(s: ShardRecord) -> bool:
    """Never leased, nothing acked: a merge changes nothing anyone was told."""
    return s.state is ShardState.TODO and s.attempt == 0 and s.acked_to == s.start and not s.acks


def merge_run(
    state: CoreState, ds: DatasetRecord, s: ShardRecord, max_shards: int, max_records: int
) -> tuple[ShardRecord, int]:
    """``s`` (about to be leased) and the fresh TODO shards after it in its partition, as one shard.

    Returns the shard to lease (``s`` itself when nothing merges) and how many planned shards it
    covers (at most ``max_shards``, at most ``max_records`` records in all). Call inside the lease's
    journal transaction: the members' rows are deleted and the merged shard's row written.
    """
    if max_shards <= 1 or max_records <= 0 or ds.kind is not SourceKind.BATCH or ds.spec.shuffle or not _fresh(s):
        return s, 1
    members = [s]
    end = s.end
    while len(members) < max_shards:
        sid = state.todo_at.get((ds.name, s.epoch, s.pindex, end))
        t = None if sid is None else state.shards.get(sid)
        if t is None or not _fresh(t) or t.end - s.start > max_records:
            break
        members.append(t)
        end = t.end
    if len(members) == 1:
        return s, 1
    journal = state.journal
    for m in members:
        state.drop_shard(m.id)
        journal.delete_shard(m.id)
    merged = ShardRecord(
        shard_id_for(ds.name, s.epoch, s.pindex, s.start, end), ds.name, s.epoch, s.pindex, s.start, end,
        priority=s.priority,
    )  # fmt: skip
    state.add_shard(merged)
    journal.put_shard(merged)
    return merged, len(members)


def merge_room(state: CoreState, ds: DatasetRecord, w: WorkerRecord, wanted: int, merge: int) -> int:
    """How many planned shards a request granted ``wanted`` (its share does not bind) may cover merged; 0: ``wanted``.

    Far from the end of a pass, the last merge may run past the shards asked for, up to its records limit: a
    refill of 3 split a row group's run of 14 into 3 + 11, a lease and an ack more. Only when the share would
    still not bind for that many more; near the end the grants stay what the guided end allows.
    """
    extra = merge // ds.shard_size if merge > 0 and ds.shard_size > 0 else 0
    return wanted + extra if extra and state.share(ds, w, wanted + extra) == wanted + extra else 0


def sized_by_records(
    ds: DatasetRecord, max_shards: int, merge_records: int, max_records: int, merge_shards: int
) -> tuple[int, int]:
    """A lease request's ``max_shards`` and ``merge_records`` once its limits in records and shards are applied.

    A reader's first lease is made before it knows the dataset's shard size (its answer brings the spec):
    it asks for about ``max_records`` records of shards (at least one) and for merges of at most
    ``merge_shards`` planned shards, which the master, knowing the size, turns into counts here.
    0 leaves a limit out.
    """
    size = ds.shard_size
    if max_records > 0:
        max_shards = min(max(max_shards, 1), max(1, -(-max_records // size)))
    if merge_shards > 0:
        merge_records = min(merge_records, merge_shards * size)
    return max_shards, merge_records


__all__ = ["merge_room", "merge_run", "sized_by_records"]
