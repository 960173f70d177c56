"""Issue 32 at 10,000 partitions: a poll costs what moved, and status pages through partitions (no broker: the core
over its journal, a stream dataset whose source is never reached, polls made up as the poller would pass them)."""

from __future__ import annotations

from pathlib import Path

from streamrover.shard_service.api import DatasetSpec
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.info import DEFAULT_STATUS_PARTITIONS, dataset_info, partition_limit
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind

P = 10_000


def _core(state: Path, now: list[float]) -> ShardCore:
    return ShardCore(Journal(state / "journal.db", exclusive=True), lease_ttl=60.0, clock=lambda: now[0])


def _poll(core: ShardCore, ends: list[int]) -> tuple[int, int]:
    polled = [Partition(f"t-{i}", 0, end, earliest=0) for i, end in enumerate(ends)]
    looked = core.streams.changed("t", polled)
    assert core.streams.upstream.check("t", polled if looked is None else looked, core.acked_cursor) == ""
    return (P if looked is None else len(looked)), core.extend_stream("t", polled)


def test_a_poll_looks_at_the_partitions_that_moved_and_a_restart_keeps_their_ends(tmp_path: Path) -> None:
    now = [1000.0]
    core = _core(tmp_path, now)
    options = {"sr.max_pending_shards": "100000"}
    spec = DatasetSpec("t", "kafka://127.0.0.1:9/t", options=options, records_per_shard=10)
    core.register_dataset(spec, SourceKind.STREAM, [Partition(f"t-{i}", 0, 0) for i in range(P)], "[]")
    ends = [0] * P
    assert _poll(core, ends) == (P, 0)  # the first poll looks at every partition
    for i in range(0, P, 100):  # 1% moved by a full shard
        ends[i] += 10
    assert _poll(core, ends) == (P // 100, P // 100)
    assert _poll(core, ends) == (0, 0)  # nothing moved: nothing looked at
    for i in range(3, P, 100):  # 1% moved by half a shard: a partial shard waits sr.max_delay_ms, looked at again
        ends[i] += 5
    assert _poll(core, ends) == (P // 100, 0)
    now[0] += 10.0
    assert _poll(core, ends) == (P // 100, P // 100)  # planned once max_delay passed
    assert _poll(core, ends) == (0, 0)
    rows = core.journal._db.execute("SELECT COUNT(*) FROM partition_ends").fetchone()[0]
    assert rows == 2 * P // 100  # the moved partitions' ends, not the list of 10,000
    core.journal.close()
    again = _core(tmp_path, now)  # a restart reads the row's list and the ends written since
    assert [p.end for p in again.dataset("t").partitions] == ends
    assert _poll(again, ends) == (P, 0)  # a new master looks at every partition once, and plans nothing anew
    again.journal.close()


def test_status_shows_the_most_lagging_partitions_and_the_totals_of_all(tmp_path: Path) -> None:
    now = [1000.0]
    core = _core(tmp_path, now)
    spec = DatasetSpec("t", "kafka://127.0.0.1:9/t", records_per_shard=10_000)  # lag, and no shard planned
    core.register_dataset(spec, SourceKind.STREAM, [Partition(f"t-{i}", 0, 0) for i in range(P)], "[]")
    ends = [i % 7 * 10 for i in range(P)]
    ends[4321] = 1000  # the most lagging
    _poll(core, ends)
    assert partition_limit(0) == DEFAULT_STATUS_PARTITIONS and partition_limit(-1) == 0 and partition_limit(5) == 5
    top = dataset_info(core, core.dataset("t"), partition_limit(0))
    assert top.partition_count == P and len(top.partitions) == DEFAULT_STATUS_PARTITIONS
    assert top.lag == sum(ends)
    assert [p.id for p in top.partitions[:2]] == ["t-4321", "t-6"]  # then lag 60 by index: 6, 13, 20...
    assert [p.lag for p in top.partitions] == sorted((p.lag for p in top.partitions), reverse=True)
    every = dataset_info(core, core.dataset("t"))
    assert len(every.partitions) == P and [p.index for p in every.partitions] == list(range(P))
    core.journal.close()


def test_the_dashboard_json_keeps_each_datasets_most_lagging_partitions() -> None:
    from streamrover.shard_service.master.web import _top

    def sample(ds: str, part: int, lag: int) -> dict[str, object]:
        return {"name": "streamrover_partition_lag_records", "labels": {"dataset": ds, "partition": f"p{part}"},
                "value": lag}  # fmt: skip

    def families() -> list[dict[str, object]]:
        lags = [sample("a", i, i % 5) for i in range(50)] + [sample("b", i, 7) for i in range(3)]
        return [{"name": "streamrover_workers", "samples": []}, {"name": "streamrover_partition_lag_records",
                                                                  "samples": lags}]  # fmt: skip

    cut = families()
    assert _top(cut, 2) == {"a": 50, "b": 3}
    shown = [(s["labels"]["dataset"], s["labels"]["partition"], s["value"]) for s in cut[1]["samples"]]
    assert shown == [("a", "p4", 4), ("a", "p9", 4), ("b", "p0", 7), ("b", "p1", 7)]
    whole = families()
    assert _top(whole, 0) == {"a": 50, "b": 3} and len(whole[1]["samples"]) == 53
