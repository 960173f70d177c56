"""History, then live (sources/history.py): a topic's Kafka-Connect-style Parquet export followed by the topic.

Against real Apache Kafka (KRaft). The seam is by offsets: one cursor over the topic's partitions, a record
applied once whether a worker read it from a file or from the broker.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from streamrover.shard_service import DatasetSpec, InvalidArgumentError, ShardClient
from streamrover.sources.api import Partition
from streamrover.sources.history import HistorySource
from streamrover.sources.history_index import HistoryError
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import start_ledger_worker
from tests.helpers import wait_until
from tests.sources.history_export import create_topic, export, produce, read_topic, write_piece
from tests.sources.stream_job import StreamJob

pytestmark = pytest.mark.slow

JSON = {"sr.format": "json", "sr.schema": "id:int64"}


def _delete_records(broker: Any, topic: str, before: dict[int, int]) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.delete_records([TopicPartition(topic, p, o) for p, o in before.items()]).values():
        f.result(30)


def _group_offsets(broker: Any, topic: str, partitions: int) -> dict[str, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"streamrover-{topic}"})
    try:
        got = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {f"{topic}-{tp.partition}": tp.offset for tp in got}
    finally:
        consumer.close()


def _frozen_at(job: StreamJob, at: int) -> int:
    """Once ``at`` records are applied, stop every worker (SIGSTOP) so an action lands there; returns how many are."""
    wait_until(lambda: job.applied() >= at, 120, f"{at} records applied", interval=0.01)
    for proc in job.procs.values():
        os.kill(proc.pid, signal.SIGSTOP)
    return job.applied()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in /proc is T."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _thaw(job: StreamJob) -> None:
    for proc in job.procs.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


def _source(broker: Any, topic: str, history: Path, **extra: str) -> HistorySource:
    return HistorySource(f"kafka://{broker.bootstrap}/{topic}", "", {**JSON, "sr.history": str(history), **extra})


def test_reads_cross_the_seam_by_offsets(tmp_path: Path, kafka_broker: Any) -> None:
    """Below the boundary a read comes from the files (the broker no longer holds those offsets), at and past it
    from the broker; batches are contiguous and the positions are the topic's offsets."""
    topic = create_topic(kafka_broker, 2)
    produce(kafka_broker, topic, range(400), 2)
    export(kafka_broker, topic, tmp_path / "lake", {0: 150, 1: 120}, per_file=60, row_group=25)
    _delete_records(kafka_broker, topic, {0: 100, 1: 120})  # retention ate part of the history's range
    source = _source(kafka_broker, topic, tmp_path / "lake")
    try:
        parts = {p.id: p for p in source.partitions()}
        assert parts[f"{topic}-0"] == Partition(f"{topic}-0", 0, 200, earliest=0, hold=150)
        assert parts[f"{topic}-1"] == Partition(f"{topic}-1", 0, 200, earliest=0, hold=120)
        batches = list(source.read(parts[f"{topic}-0"], 90, 170, 40))
        spans = [(b.start, b.end) for b in batches]
        assert spans[0][0] == 90 and spans[-1][1] == 170 and all(x[1] == y[0] for x, y in itertools.pairwise(spans))
        assert (150, 170) in spans and all(b.num_records <= 40 for b in batches)  # the seam: files, then broker
        ids = [i for b in batches for i in b.records.column("id").to_pylist()]
        assert ids == [2 * o for o in range(90, 170)]  # partition 0 holds the even ids, id = 2 * offset
        assert [o for b in batches for o in b.positions.to_pylist()] == list(range(90, 170))  # type: ignore[union-attr]
    finally:
        source.close()


def test_a_history_that_does_not_fit_the_topic_is_refused(tmp_path: Path, kafka_broker: Any, master: Any) -> None:
    """Overlap, gaps (between files, before and after the topic's earliest), offsets the topic never produced,
    partitions it lacks: each refused at registration, naming the partition and the offsets."""
    topic = create_topic(kafka_broker, 2)
    produce(kafka_broker, topic, range(200), 2)
    rows = {p: read_topic(kafka_broker, topic, p, 100) for p in (0, 1)}

    def lake(name: str, pieces: list[tuple[int, int, int]]) -> Path:  # (partition, first offset, end offset)
        root = tmp_path / name
        root.mkdir()
        for p, a, b in pieces:
            write_piece(root / f"{topic}+{p}+{a:010d}.parquet", p, rows[p][a:b])
        return root

    def refused(root: Path, match: str) -> None:
        with pytest.raises(HistoryError, match=match):
            _source(kafka_broker, topic, root).partitions()

    refused(lake("overlap", [(0, 0, 60), (0, 50, 100)]), rf"{topic}-0: offsets \[50, 60\) are in two files")
    refused(lake("hole", [(0, 0, 40), (0, 50, 100)]), rf"{topic}-0: offsets \[40, 50\) are in no file")
    refused(lake("late", [(1, 10, 100)]), rf"history of {topic}-1 starts at offset 10 .* \[0, 10\) would be skipped")
    beyond = tmp_path / "beyond"
    beyond.mkdir()
    write_piece(beyond / f"{topic}+0+0000000000.parquet", 0, [(o, 0, 0) for o in range(120)])
    refused(beyond, rf"history of {topic}-0 holds offsets \[100, 120\) that the topic has not produced")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    write_piece(foreign / f"{topic}+7+0000000000.parquet", 7, [(0, 0, 0)])
    refused(foreign, rf"partition\(s\) {topic}-7 that topic")
    # Gaps between files are accepted when the user says the topic holds nothing there.
    assert _source(kafka_broker, topic, lake("allowed", [(0, 0, 40), (0, 50, 100)]), **{"sr.history.gaps": "allow"})

    # Retention passed the boundary: [60, 80) is neither exported nor in the topic. Refused over RPC too.
    short = lake("short", [(0, 0, 60), (1, 0, 100)])
    _delete_records(kafka_broker, topic, {0: 80})
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=30)
    try:
        uri = f"kafka://{kafka_broker.bootstrap}/{topic}"
        spec = DatasetSpec("chain", uri, options={**JSON, "sr.history": str(short)})
        gap = rf"history of {topic}-0 ends at offset 60 .* \[60, 80\) are in neither"
        with pytest.raises(InvalidArgumentError, match=gap):
            admin.register_dataset(spec)
        with pytest.raises(InvalidArgumentError, match="sr.start"):
            admin.register_dataset(DatasetSpec("c2", spec.uri, options={**spec.options, "sr.start": "earliest"}))
    finally:
        admin.close()


@pytest.mark.parametrize("by", ["offsets", "time"])
def test_history_then_live_exact_under_kills_at_the_seam(tmp_path: Path, kafka_broker: Any, by: str) -> None:
    """The acceptance test: history = the topic's first records exported, live = the topic.

    By offsets (the files carry them), or by time (they carry only timestamps; 4 records share each
    millisecond, the boundary's too, and the export holds 8 records past the boundary). Workers are SIGKILLed
    just before, at and just after the boundary, the master once during the handoff; a checkpoint is taken
    every 0.3 s throughout. Every record is applied exactly once, the history entirely before anything live,
    and the consumer group ends at the end offsets.
    """
    rng = random.Random()
    partitions, first, total = 2, 6_000, 10_000
    topic = create_topic(kafka_broker, partitions)
    t0 = (int(time.time()) - 3_600) * 1_000
    stamps = {i: t0 + i // 4 for i in range(first)}
    produce(kafka_broker, topic, stamps, partitions)
    options = {**JSON, "sr.history": str(tmp_path / "lake"), "sr.max_delay_ms": "200"}
    if by == "offsets":
        boundary = {0: 2_600, 1: 2_400}  # offsets per partition in the history
        export(kafka_broker, topic, tmp_path / "lake", boundary, per_file=500, row_group=100)
        history = sum(boundary.values())
    else:
        instant = t0 + 1_250  # ids 5,000-5,003 share it
        (tmp_path / "lake").mkdir()
        for n in range(0, 5_008, 500):  # exported 2 ms late: through id 5,007
            rows = range(n, min(n + 500, 5_008))
            table = pa.table({"id": list(rows), "timestamp": [stamps[i] for i in rows]})
            pq.write_table(table, tmp_path / "lake" / f"part-{n:05d}.parquet", row_group_size=100)
        options["sr.history.boundary"] = f"timestamp:{instant}"
        history = 5_000
    _delete_records(kafka_broker, topic, {0: 1_500, 1: 1_000})  # retention: the broker lost part of the history
    job = StreamJob(tmp_path, f"kafka://{kafka_broker.bootstrap}/{topic}", options, records_per_shard=250, workers=0)
    job.batch_size = 50
    try:
        job.start()
        # w1 reads alone and stops itself (SIGSTOP) after writing its 90th batch, before acking it: records
        # 4,451-4,500 of the 5,000 of the history (nothing live is planned before the history is acked), applied
        # and not acked when it is SIGKILLed: just before the boundary.
        with open(tmp_path / "w1.log", "ab") as log:
            job.procs["w1"] = start_ledger_worker(
                job.master, "stream", job.ledger_path, name="w1", batch_size=50, extra=["--pause-at-batch", "90"],
                stdout=log,
            )  # fmt: skip
        later = threading.Thread(target=produce, args=(kafka_broker, topic, range(first, total), partitions))
        later.start()
        wait_until(lambda: _stopped(job.procs["w1"].pid), 90, "w1 to stop itself after its 90th batch")
        moments = [job.applied()]
        job.procs["w1"].kill()
        job.procs["w1"].wait()
        job.events.append(f"{moments[0]} applied (history {history}): SIGKILL w1 with a written, unacked batch")
        for name in ("w0", "w1"):
            job.start_worker(name)
        for at, action in [
            (history - 100, job.kill_master),  # the handoff: the last history shards acked, live planned
            (history, lambda: job.kill_worker(rng)),  # at it: the history applied, nothing live yet
            (history + 300, lambda: job.kill_worker(rng)),  # just after it
        ]:
            moments.append(_frozen_at(job, at))
            action()
            job.events.append(f"  at {moments[-1]} applied (history {history})")
            _thaw(job)
        later.join()
        report, cursor, finished = job.finish(total)
        info: Any = finished
        print(job.events, report)
        assert report.exact, f"{job.events}: {report}\n{job.logs()}"
        assert report.conflicts == 0
        for p in info.partitions:  # the cursor: every partition from its start to its end, once
            assert cursor.get(PartitionKey("stream", 0, p.id)) == IntervalSet([(p.start, p.available_end)])
        ends = {p.id: p.available_end for p in info.partitions if p.id.startswith(topic)}
        assert ends == {f"{topic}-0": total // 2, f"{topic}-1": total // 2}
        wait_until(lambda: _group_offsets(kafka_broker, topic, partitions) == ends, 30, f"group offsets {ends}")
        # The history was learned before anything live: every ledger write below a partition's boundary
        # precedes every write at or past it.
        led = Ledger(job.ledger_path)
        rows = led._db.execute("SELECT rowid, shard_id, start FROM chunks").fetchall()
        led.close()
        if by == "offsets":
            bound = {p.index: boundary[int(p.id.rsplit("-", 1)[1])] for p in info.partitions}
        else:  # the history's partitions are its row groups
            bound = {p.index: (1 << 62) if p.id.startswith("history:") else 0 for p in info.partitions}
        past = [r for r, sid, start in rows if start < bound[int(sid.split("/")[2])]]
        live = [r for r, sid, start in rows if start >= bound[int(sid.split("/")[2])]]
        assert past and live and max(past) < min(live)
        assert moments[0] < history == moments[2] < moments[3], f"the kills missed the seam: {job.events}"
    finally:
        job.stop()


def _consume(client: ShardClient, shards: int) -> list[int]:
    """Lease, read and ack ``shards`` whole shards one at a time (each one batch); returns the ids, in order."""
    ids: list[int] = []
    done = 0
    while done < shards:
        _, got = client.lease("chain", max_shards=1, wait=2.0)
        for shard in got:
            for batch in shard.batches(10_000):
                ids += batch.records.column("id").to_pylist()
                shard.ack(batch.end)
            done += 1
    return ids


def test_a_checkpoint_mid_history_or_mid_live_restores_exactly(tmp_path: Path, kafka_broker: Any, master: Any) -> None:
    """Cuts taken mid-history and mid-live are restored: exactly the records outside each cut's cursor are read
    again, once, and after the mid-history restore the live part waits for the history again."""
    topic = create_topic(kafka_broker, 2)
    produce(kafka_broker, topic, range(1_200), 2)
    export(kafka_broker, topic, tmp_path / "lake", {0: 400, 1: 400}, per_file=150, row_group=50)
    _delete_records(kafka_broker, topic, {0: 300, 1: 300})
    uri = f"kafka://{kafka_broker.bootstrap}/{topic}"
    options = {**JSON, "sr.history": str(tmp_path / "lake"), "sr.max_delay_ms": "100"}
    client = ShardClient(master.address, token=master.token, name="reader", timeout=60)
    try:
        client.register_dataset(DatasetSpec("chain", uri, options=options, records_per_shard=100))
        everything = set(range(1_200))
        first = _consume(client, 3)  # 300 history records
        cut, mid_history = client.prepare_cut()
        client.commit_cut(cut)
        second = _consume(client, 7)  # the rest of the history (500) and 200 live records
        cut, mid_live = client.prepare_cut()
        client.commit_cut(cut)
        third = _consume(client, 2)  # the last 200
        assert sorted(first + second + third) == sorted(everything)
        history = {2 * o + p for p in (0, 1) for o in range(400)}  # partition p holds ids 2*offset + p
        assert set(first + second[:500]) == history  # nothing live before the history was acked

        client.restore_cursor(mid_live)
        again = _consume(client, 2)
        assert sorted(again) == sorted(third)

        client.restore_cursor(mid_history)
        replay = _consume(client, 9)
        assert sorted(replay) == sorted(everything - set(first))
        assert set(replay[:500]) == history - set(first)  # the history first again, then live
    finally:
        client.close()


def _consume_ids(client: ShardClient, want: int, timeout: float = 60, dataset: str = "chain") -> list[tuple[str, int]]:
    """Lease, read and ack shards until ``want`` records are read; returns (partition id, id) in order."""
    got: list[tuple[str, int]] = []
    give_up = time.monotonic() + timeout
    while len(got) < want:
        assert time.monotonic() < give_up, f"only {len(got)} of {want} records read in {timeout}s"
        _, shards = client.lease(dataset, max_shards=1, wait=1.0)
        for shard in shards:
            for batch in shard.batches(10_000):
                got += [(shard.lease.partition.id, i) for i in batch.records.column("id").to_pylist()]
                shard.ack(batch.end)
    return got


def test_by_time_records_sharing_the_boundary_millisecond_are_trained_once(
    tmp_path: Path, kafka_broker: Any, master: Any
) -> None:
    """Boundary T: the history's records before T, the topic's at or after T. The history was exported a little
    late (it holds records of T and after) and a producer's late records (timestamped before T) sit in the topic
    past offsets_for_times(T): each record is still trained once, those of the boundary millisecond from the
    topic, the late ones from the history, and nothing live before the history is acked."""
    t0 = (int(time.time()) - 3_600) * 1_000
    boundary = t0 + 100
    stamp = {i: t0 + i // 8 for i in range(1_600)}  # 8 records per millisecond: ids 800-807 share T
    late = {i: boundary - 5 for i in range(1_600, 1_604)}  # produced after T's records, timestamped before
    topic = create_topic(kafka_broker, 2)
    produce(kafka_broker, topic, {**stamp, **late}, 2)
    exported = {i: ts for i, ts in {**stamp, **late}.items() if ts < boundary + 3}  # exported 3 ms late
    lake = tmp_path / "lake"
    lake.mkdir()
    items = sorted(exported.items())
    for n, half in enumerate((items[: len(items) // 2], items[len(items) // 2 :])):
        table = pa.table({"id": [i for i, _ in half], "timestamp": [ts for _, ts in half]})
        pq.write_table(table, lake / f"part-{n}.parquet", row_group_size=150)
    options = {**JSON, "sr.history": str(lake), "sr.history.boundary": f"timestamp:{boundary}"}
    options["sr.max_delay_ms"] = "100"
    uri = f"kafka://{kafka_broker.bootstrap}/{topic}"
    client = ShardClient(master.address, token=master.token, name="reader", timeout=60)
    try:
        client.register_dataset(DatasetSpec("chain", uri, options=options, records_per_shard=100))
        got = _consume_ids(client, 1_604)
        produce(kafka_broker, topic, dict.fromkeys(range(1_604, 1_700), t0 + 500), 2)  # live goes on
        got += _consume_ids(client, 96)
        # Retention took partition 0's records through offset 499 (ids up to 999: past T): records at or after T
        # may be in neither the history nor the topic, so the same chain is refused now.
        _delete_records(kafka_broker, topic, {0: 500})
        with pytest.raises(InvalidArgumentError, match=rf"{topic}-0: the topic's records before offset 500 were del"):
            client.register_dataset(DatasetSpec("again", uri, options=options, records_per_shard=100))
    finally:
        client.close()
    ids = [i for _, i in got]
    assert sorted(ids) == list(range(1_700)), "a record trained twice or skipped"
    source = {i: "history" if pid.startswith("history:") else "live" for pid, i in got}
    assert {i for i in range(800, 808)} <= {i for i, s in source.items() if s == "live"}  # the boundary ms: topic
    assert all(source[i] == "history" for i in late)  # timestamped before T: history, skipped in the topic
    assert all(source[i] == ("history" if ts < boundary else "live") for i, ts in stamp.items())
    first_live = min(n for n, (pid, _) in enumerate(got) if not pid.startswith("history:"))
    assert all(pid.startswith("history:") for pid, _ in got[:first_live]) and first_live == 800 + 4


def test_the_index_comes_from_statistics_and_a_row_group_out_of_order_is_refused_when_read(tmp_path: Path) -> None:
    """Pieces come from the row groups' statistics (no data read to build the index); a row group whose offsets
    do not increase is refused when a worker reads it, naming the file and the offsets."""
    from streamrover.sources.api import SourceUnreadableError
    from streamrover.sources.history_index import HistoryReader, build_index

    write_piece(tmp_path / "t+0+0000000000.parquet", 0, [(o, o, 0) for o in range(100)], row_group=40)
    write_piece(tmp_path / "t+0+0000000100.parquet", 0, [(o, o, 0) for o in (100, 102, 101, 103)])
    index = build_index(str(tmp_path), "t", "offset", "partition", allow_gaps=False)
    pieces = [(p.first, p.last, p.rows) for p in index.pieces[0]]
    assert pieces == [(0, 39, 40), (40, 79, 40), (80, 99, 20), (100, 103, 4)]
    reader = HistoryReader(str(tmp_path), index, pa.schema([("id", pa.int64())]))
    assert [b[0].num_rows for b in reader.read(0, 10, 90, 1_000)] == [30, 40, 10]
    with pytest.raises(SourceUnreadableError, match=r"offsets \[100, 104\)\): offsets do not increase"):
        list(reader.read(0, 95, 104, 1_000))


def test_epochs_and_shuffle_apply_to_the_history_only(tmp_path: Path, kafka_broker: Any, master: Any) -> None:
    """``epochs=3, shuffle``: the history is trained three times, each epoch shuffled and wholly acked before the
    next, then the live part in order. A cut taken inside the second epoch restores exactly: the rest of that
    epoch, then the third, then live. A plain stream still refuses epochs."""
    topic = create_topic(kafka_broker, 2)
    produce(kafka_broker, topic, range(1_000), 2)
    export(kafka_broker, topic, tmp_path / "lake", {0: 300, 1: 300}, per_file=150, row_group=50)
    uri = f"kafka://{kafka_broker.bootstrap}/{topic}"
    options = {**JSON, "sr.history": str(tmp_path / "lake"), "sr.max_delay_ms": "100"}
    history = sorted(2 * o + p for p in (0, 1) for o in range(300))  # partition p holds ids 2*offset + p
    client = ShardClient(master.address, token=master.token, name="reader", timeout=60)
    try:
        with pytest.raises(InvalidArgumentError, match="epochs and shuffle apply to batch data and to a stream's hi"):
            client.register_dataset(DatasetSpec("plain", uri, options=JSON, epochs=2))
        spec = DatasetSpec("chain", uri, options=options, records_per_shard=50, epochs=3, shuffle=True, seed=7)
        info = client.register_dataset(spec).dataset
        assert sorted(p.id for p in info.partitions if "/" in p.id) == [
            f"epoch{k}/{topic}-{p}" for k in (0, 1) for p in (0, 1)
        ]
        first = _consume_ids(client, 600)
        second = _consume_ids(client, 200)  # a third of the second epoch
        cut, mid_epoch = client.prepare_cut()
        client.commit_cut(cut)
        rest = _consume_ids(client, 400 + 600 + 400)  # the second epoch's rest, the third, live
        assert sorted(i for _, i in first) == history and sorted(i for _, i in second + rest[:400]) == history
        assert sorted(i for _, i in rest[400:1_000]) == history
        live = rest[1_000:]
        assert sorted(i for _, i in live) == sorted(set(range(1_000)) - set(history))
        assert all(pid.startswith("epoch0/") for pid, _ in first)
        assert all(pid.startswith("epoch1/") for pid, _ in second + rest[:400])
        assert all("/" not in pid for pid, _ in rest[400:]) and not any(pid.startswith("history") for pid, _ in live)
        epochs = [[i for _, i in first], [i for _, i in second + rest[:400]], [i for _, i in rest[400:1_000]]]
        assert epochs[0] != history and epochs[0] != epochs[1] != epochs[2]  # shuffled, each epoch anew
        for p in (0, 1):  # live in order within each partition
            ids = [i for pid, i in live if pid == f"{topic}-{p}"]
            assert ids == sorted(ids)

        client.restore_cursor(mid_epoch)
        replay = _consume_ids(client, 400)
        # The last epoch leased whole and not acked: nothing live is leased until it is.
        held = [s for _ in range(12) for s in client.lease("chain", max_shards=1, wait=2.0)[1]]
        assert len(held) == 12 and all("/" not in s.lease.partition.id for s in held)
        assert client.lease("chain", max_shards=1, wait=0.5)[1] == []
        for shard in held:
            for batch in shard.batches(10_000):
                replay += [(shard.lease.partition.id, i) for i in batch.records.column("id").to_pylist()]
                shard.ack(batch.end)
        replay += _consume_ids(client, 400)
        assert sorted(i for _, i in replay[:400]) == sorted(i for _, i in rest[:400])  # exactly the epoch's rest
        assert all(pid.startswith("epoch1/") for pid, _ in replay[:400])
        assert sorted(i for _, i in replay[400:1_000]) == history and all("/" not in p for p, _ in replay[400:])
        assert sorted(i for _, i in replay[1_000:]) == sorted(i for _, i in live)

        # By time: the history's row groups are trained twice, then the topic from the boundary.
        timed, t0 = create_topic(kafka_broker, 2), (int(time.time()) - 3_600) * 1_000
        produce(kafka_broker, timed, {i: t0 + i for i in range(400)}, 2)
        (tmp_path / "timed").mkdir()
        pq.write_table(pa.table({"id": list(range(200)), "timestamp": [t0 + i for i in range(200)]}),
                       tmp_path / "timed" / "part-0.parquet", row_group_size=100)  # fmt: skip
        by_time = {**JSON, "sr.history": str(tmp_path / "timed"), "sr.history.boundary": f"timestamp:{t0 + 200}"}
        uri = f"kafka://{kafka_broker.bootstrap}/{timed}"
        client.register_dataset(DatasetSpec("timed", uri, options=by_time, records_per_shard=50, epochs=2))
        got = _consume_ids(client, 600, dataset="timed")
        assert [sorted(i for _, i in got[k : k + 200]) for k in (0, 200, 400)] == [
            list(range(200)), list(range(200)), list(range(200, 400))
        ]  # fmt: skip
        assert all(p.startswith("epoch0/history:") for p, _ in got[:200])
        assert all(p.startswith("history:") for p, _ in got[200:400])
    finally:
        client.close()
