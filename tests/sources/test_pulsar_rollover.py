"""Ledger rollovers on real Apache Pulsar (standalone from Maven jars): positions jump, records are counted.

pulsar-lite never rolls a ledger (every message id it issues is in ledger 0, across restarts too), so
this runs a real Pulsar standalone with 50-entry ledgers (tests/brokers/pulsar_standalone.py): a
partition's positions (``ledger << 24 | entry``) jump by a multiple of 2**24 every 50 messages. The
stream is trained exactly once under a worker and a master SIGKILL, the source reads the partitions
of a partitioned topic ``direct`` (the way real Pulsar is read), and status counts records: lag,
records acked and committed, shards committed, and the shards a restore re-plans.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.sources.pulsar import PositionCodec, PulsarSource
from tests.brokers.pulsar_standalone import PulsarStandalone
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pulsar = pytest.importorskip("pulsar")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ENTRIES_PER_LEDGER = 50
SHARD = 250


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarStandalone]:
    broker = PulsarStandalone(tmp_path_factory.mktemp("pulsar-standalone"), entries_per_ledger=ENTRIES_PER_LEDGER)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _produce(broker: PulsarStandalone, topic: str, ids: range) -> None:
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(f"persistent://public/default/{topic}", batching_enabled=False)
        for i in ids:
            producer.send(json.dumps({"id": i}).encode(), partition_key=str(i))
        producer.close()
    finally:
        client.close()


def _ledgers(info: Any) -> int:
    """How many ledgers the partitions' extents span (each jump of the ledger id is a rollover)."""
    codec = PositionCodec()
    return sum(codec.decode(p.end - 1)[0] - codec.decode(p.start)[0] for p in info.partitions)


def test_rollovers_train_once_and_count_records(tmp_path: Path, standalone: PulsarStandalone) -> None:
    rng = random.Random()
    total, topic = 3_000, f"r-{uuid.uuid4().hex[:8]}"
    standalone.create_partitioned_topic(topic, 2)
    opts = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200", "operation_timeout_seconds": "30"}
    job = StreamJob(tmp_path, f"{standalone.service_url}/{topic}", opts, records_per_shard=SHARD)
    source = PulsarSource(job.uri, "", opts)
    try:
        source.partitions()  # creates the subscription before anything is produced (retention aside)
        assert source.mode == "direct"
    finally:
        source.close()
    _produce(standalone, topic, range(total))
    try:
        job.start()
        job.run_chaos(total, [lambda: job.kill_worker(rng), job.kill_master], rng)
        report, cursor, finished = job.finish(total)
        info: Any = finished
        assert report.exact, f"{job.events}: {report}\n{job.logs()}"
        assert len(info.partitions) == 2
        assert _ledgers(info) >= total // ENTRIES_PER_LEDGER - 2  # the positions jumped at every rollover
        assert sum(p.end - p.start for p in info.partitions) > 1000 * total
        assert (info.records_committed, info.records_acked, info.total_records, info.lag) == (total, total, total, 0)
        for part in info.partitions:
            assert cursor.get(PartitionKey("stream", 0, part.id)) == IntervalSet([(part.start, part.end)])
            assert part.lag == 0 and part.committed_end == part.end

        # No worker now: records produced later are lag, counted as records across their rollovers.
        for name in sorted(job.procs):
            job.procs[name].kill()
            job.procs[name].wait()
        more = 400
        _produce(standalone, topic, range(total, total + more))
        with job.admin() as admin:
            wait_until(lambda: admin.describe_dataset("stream").lag == more, 60, f"lag of {more} records")
            info = admin.describe_dataset("stream")
            assert sum(p.lag for p in info.partitions) == more
            wait_until(lambda: admin.describe_dataset("stream").total_records == total + more, 60, "all planned")

            # Restore to the first record of each partition: the rest is re-planned in shards of SHARD records.
            first = DataCursor(
                {PartitionKey("stream", 0, p.id): IntervalSet([(p.start, p.start + 1)]) for p in info.partitions}
            )
            resp = admin.restore_cursor(first)
            info = admin.describe_dataset("stream")
        assert resp.records_requeued == total + more - 2
        assert info.lag == total + more - 2 and info.records_committed == 2
        # Each partition's records but its first, on a grid of SHARD records from its start.
        expected = sum(math.ceil((p.lag + 1) / SHARD) for p in info.partitions)
        assert info.shards.todo == expected, f"{info.shards.todo} shards re-planned, {expected} expected"
    finally:
        job.stop()


def test_a_restarted_masters_source_learns_ledgers_from_the_committed_point(standalone: PulsarStandalone) -> None:
    """A fresh source (a restarted master's) walks the ledgers from the subscription's committed point on.

    The runs before it are the master's already (journalled); walking the retained history again
    would cost a read of all of it.
    """
    topic = f"w-{uuid.uuid4().hex[:8]}"
    uri, opts = f"{standalone.service_url}/{topic}", {"operation_timeout_seconds": "30"}
    first = PulsarSource(uri, "", opts)
    try:
        assert first.partitions() == []  # creates the subscription; no message yet
        _produce(standalone, topic, range(20 * ENTRIES_PER_LEDGER))
        [part] = first.partitions()
        runs = list(part.segments or ())
        assert len(runs) == 20 and sum(b - a for a, b in runs) == 20 * ENTRIES_PER_LEDGER
        committed = runs[12][0] + 10  # inside the 13th ledger
        first.commit({part.id: committed})
        [part] = first.poll()  # the committed ledgers are forgotten (one run per ledger would grow without bound)
        assert list(part.segments or ()) == runs[12:], f"{len(part.segments or ())} runs still reported"
    finally:
        first.close()
    again = PulsarSource(uri, "", opts)
    try:
        [part] = again.partitions()
    finally:
        again.close()
    known = list(part.segments or ())
    assert [r for r in known if r[1] > committed] == [(committed, runs[12][1]), *runs[13:]]
    assert not set(runs[1:12]) & set(known), f"walked the committed ledgers again: {known}"
