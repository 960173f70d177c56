"""RocketMQ streams end to end, against a real RocketMQ 5.x name server and broker.

Records with unique ids are produced across message queues (with the 4.x client, ``rocketmq``
0.4.4) while ledger worker processes consume them through shards; a worker and the master are
SIGKILLed at random moments. The ledger must be exact and the consumer group's offsets on the
broker (read back with QUERY_CONSUMER_OFFSET) must equal the committed cursor.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from streamrover.sources.api import SourceGoneError, open_source
from streamrover.sources.rocketmq_remoting import RemotingClient
from tests.brokers.rocketmq import RocketMQBroker
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
pytest.importorskip("rocketmq", reason="rocketmq 0.4.4 (the 4.x remoting client) is not installed")


# The producer runs in a child process. librocketmq's producer once aborted the whole pytest run (SIGABRT in
# Producer.shutdown, after every send_sync had returned, just after a broker restart: rehearsal of 97d0e16). A
# crash of that test-only client then fails only the test that needs its records, and a child that sent them all
# and then crashed in shutdown is reported and not counted as a lost record: the broker confirmed each send.
_PRODUCER = """
import base64, json, sys, uuid
from streamrover.sources.rocketmq import librocketmq
librocketmq()  # first: the library deep-bound (as a process that imported TensorFlow needs)
from rocketmq.client import Message, Producer
from rocketmq.ffi import dll
job = json.load(sys.stdin)
producer = Producer(f"test-producer-{uuid.uuid4().hex[:8]}", timeout=10_000)
producer.set_namesrv_addr(job["namesrv"])
producer.start()
for encoded in job["bodies"]:
    value = base64.b64decode(encoded)
    msg = Message(job["topic"])
    dll.SetByteMessageBody(msg._handle, value, len(value))  # set_body would cut a body at a NUL byte
    producer.send_sync(msg)
print(f"sent {len(job['bodies'])}", flush=True)
producer.shutdown()
"""


def _produce(broker: RocketMQBroker, topic: str, ids: range, body: Callable[[int], bytes] | None = None) -> None:
    """Send ``{"id": i}`` (or ``body(i)``) for each id, synchronously (the producer spreads them over the queues)."""
    bodies = [body(i) if body else json.dumps({"id": i}).encode() for i in ids]
    job = {"namesrv": broker.namesrv_address, "topic": topic, "bodies": [base64.b64encode(b).decode() for b in bodies]}
    res = subprocess.run([sys.executable, "-c", _PRODUCER], input=json.dumps(job), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert f"sent {len(bodies)}" in res.stdout, f"the producer failed (exit {res.returncode}): {res.stderr[-3000:]}"
    if res.returncode != 0:
        print(f"librocketmq's producer sent all {len(bodies)} records, then exited {res.returncode} in its shutdown")


def _group_offsets(broker: RocketMQBroker, group: str, topic: str, queues: int) -> dict[str, int | None]:
    client = RemotingClient()
    try:
        return {
            f"{topic}@{broker.broker_name}-{q}": client.query_consumer_offset(broker.broker_address, group, topic, q)
            for q in range(queues)
        }
    finally:
        client.close()


def test_rocketmq_stream_ledger_exact_under_worker_and_master_kills(
    tmp_path: Path, rocketmq_broker: RocketMQBroker
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    total, queues = 6_000, 4
    topic = f"t-{uuid.uuid4().hex[:8]}"
    rocketmq_broker.create_topic(topic, queues)
    _produce(rocketmq_broker, topic, range(0, total // 2))
    options = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200"}
    job = StreamJob(tmp_path, f"rocketmq://{rocketmq_broker.namesrv_address}/{topic}", options,
                    records_per_shard=300, batch_size=100)
    try:
        job.start()
        later = threading.Thread(target=_produce, args=(rocketmq_broker, topic, range(total // 2, total)))
        later.start()  # the second half arrives while the job runs
        job.run_chaos(total, [lambda: job.kill_worker(rng), job.kill_master], rng)
        later.join()
        report, cursor, info = job.finish(total)
        assert len(job.events) == 2, job.events  # a worker and the master were SIGKILLed mid-run
        assert report.exact, f"seed {seed}, {job.events}: {report}\n{job.logs()}"
        assert report.conflicts == 0
        ends = {p.id: p.available_end for p in info.partitions}
        assert sorted(ends) == [f"{topic}@{rocketmq_broker.broker_name}-{q}" for q in range(queues)]
        assert sum(ends.values()) == total  # dense queue offsets: one position per record
        assert sum(1 for end in ends.values() if end) > 1, "all records landed in one queue"
        for part in info.partitions:  # the committed cursor covers each queue from 0 to its end, once
            assert cursor.get(PartitionKey("stream", 0, part.id)) == IntervalSet([(0, ends[part.id])])
        # ... and the consumer group's offsets on the broker equal it.
        group = f"streamrover-{topic}"
        wait_until(lambda: _group_offsets(rocketmq_broker, group, topic, queues) == ends, 30,
                   f"consumer offsets of {group} to equal {ends}")
        assert info.lag == 0
    finally:
        job.stop()


def test_rocketmq_source_binary_bodies_dead_letters_and_start_positions(
    tmp_path: Path, rocketmq_broker: RocketMQBroker
) -> None:
    """Raw bodies come back byte for byte (NULs included); bad JSON goes to dead letters; sr.start works."""
    topic = f"t-{uuid.uuid4().hex[:8]}"
    rocketmq_broker.create_topic(topic, 2)
    bodies = {i: (b"\x00bin\x00%d\xff" % i if i % 10 == 0 else json.dumps({"id": i}).encode()) for i in range(200)}
    _produce(rocketmq_broker, topic, range(200), bodies.__getitem__)
    uri = f"rocketmq://{rocketmq_broker.namesrv_address}/{topic}"

    raw = open_source(uri)
    try:
        parts = raw.partitions()
        assert [p.start for p in parts] == [0, 0] and sum(p.end for p in parts) == 200
        got = []
        for p in parts:
            batches = list(raw.read(p, 0, p.end, 7))
            assert batches[-1].end == p.end and all(b.num_records <= 7 for b in batches)
            offsets = [o for b in batches for o in b.records.column("offset").to_pylist()]
            assert offsets == list(range(p.end))  # dense queue offsets
            got += [v for b in batches for v in b.records.column("body").to_pylist()]
        assert sorted(got) == sorted(bodies.values())
        middle = list(raw.read(parts[0], 3, 9, 100))  # a shard in the middle ends at its end
        assert [(b.start, b.end, b.num_records) for b in middle] == [(3, 9, 6)]
        raw.commit({parts[0].id: 5, parts[1].id: 0})
    finally:
        raw.close()

    options = {"sr.format": "json", "sr.schema": "id:int64", "sr.dead_letter_dir": str(tmp_path / "dead")}
    decoded = open_source(uri, options={**options, "sr.start": "group"})
    try:
        parts = decoded.partitions()
        assert [p.start for p in parts] == [5, 0]
        batches = [b for p in parts for b in decoded.read(p, p.start, p.end, 50)]
        ids = [i for b in batches for i in b.records.column("id").to_pylist()]
        dead = sum(b.dead_letters for b in batches)
        assert dead == len(list((tmp_path / "dead").iterdir())) and len(ids) + dead == 200 - 5
        assert len(set(ids)) == len(ids) and all(i % 10 for i in ids)
    finally:
        decoded.close()
    latest = open_source(uri, options={"sr.start": "latest"})
    try:
        assert all(p.start == p.end for p in latest.partitions())
    finally:
        latest.close()
    with pytest.raises(SourceGoneError, match="does not exist"):
        open_source(f"rocketmq://{rocketmq_broker.namesrv_address}/no-such-{topic}").poll()


_READ_AFTER_TENSORFLOW = """
import sys
import tensorflow  # first, as a TF trainer does: its libraries' symbols are the process's from here on
from streamrover.sources.api import open_source
source = open_source(sys.argv[1], options={"sr.format": "json", "sr.schema": "id:int64"})
ids = [i for p in source.partitions() for b in source.read(p, 0, p.end, 50) for i in b.records.column("id").to_pylist()]
source.close()
print(sorted(ids) == list(range(int(sys.argv[2]))), len(ids))
"""


def test_a_process_that_imported_tensorflow_first_reads_a_rocketmq_topic(rocketmq_broker: RocketMQBroker) -> None:
    """librocketmq bound to TensorFlow's symbols crashed its first pull (SIGSEGV): the reader loads it deep-bound."""
    topic = f"t-{uuid.uuid4().hex[:8]}"
    rocketmq_broker.create_topic(topic, 2)
    _produce(rocketmq_broker, topic, range(300))
    uri = f"rocketmq://{rocketmq_broker.namesrv_address}/{topic}"
    done = subprocess.run([sys.executable, "-c", _READ_AFTER_TENSORFLOW, uri, "300"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["True", "300"], (done.returncode, done.stderr[-3000:])


@pytest.mark.parametrize("with_namesrv", [False, True], ids=["broker", "broker+namesrv"])
def test_rocketmq_broker_restart_is_not_a_topic_deletion(
    tmp_path: Path, rocketmq_broker: RocketMQBroker, with_namesrv: bool
) -> None:
    """SIGKILL the broker (and its name server) mid-stream and start it again: until the broker has registered its
    routes the name server says the topic does not exist; the dataset waits (status says so) and goes on."""
    rng = random.Random()
    total, queues = 3_000, 2
    topic = f"t-{uuid.uuid4().hex[:8]}"
    rocketmq_broker.create_topic(topic, queues)
    _produce(rocketmq_broker, topic, range(0, total // 2))
    # workers retry a pull for as long as the restart takes on a loaded machine
    options = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200", "sr.read_timeout_ms": "240000"}
    job = StreamJob(tmp_path, f"rocketmq://{rocketmq_broker.namesrv_address}/{topic}", options,
                    records_per_shard=300, batch_size=100)
    try:
        job.start()
        moment = rng.uniform(0.1, 0.4)
        wait_until(lambda: job.applied() >= moment * total, 180, f"{moment:.0%} of the records applied")
        with job.admin() as admin:
            try:
                if with_namesrv:
                    rocketmq_broker.kill()
                else:
                    rocketmq_broker.kill_broker()
                job.events.append("SIGKILL broker" + (" and name server" if with_namesrv else ""))
                wait_until(lambda: admin.describe_dataset("stream").error != "", 60, "status to show the outage")
            finally:
                rocketmq_broker.start()  # also when the check failed: the broker is shared with later tests
            info = admin.describe_dataset("stream")
            assert not info.failed, f"a broker restart failed the dataset: {info.error}"
        _produce(rocketmq_broker, topic, range(total // 2, total))
        report, _, info = job.finish(total)
        assert report.exact, f"{job.events}: {report}\n{job.logs()}"
        assert not info.failed, info.error
        job.wait_outage_cleared()
    finally:
        job.stop()


def test_a_process_that_read_a_rocketmq_source_exits_without_close(rocketmq_broker: RocketMQBroker) -> None:
    """A worker whose loop raises must end (its agent restarts it): librocketmq's pull consumer kept it alive."""
    import subprocess
    import sys

    from streamrover.testing.procs import python_env

    topic = f"t-{uuid.uuid4().hex[:8]}"
    rocketmq_broker.create_topic(topic, 1)
    _produce(rocketmq_broker, topic, range(10))
    script = (
        "from streamrover.sources.api import open_source\n"
        f"src = open_source('rocketmq://{rocketmq_broker.namesrv_address}/{topic}')\n"
        "p = src.partitions()[0]\n"
        "assert sum(b.num_records for b in src.read(p, 0, p.end, 100)) == 10\n"
        "raise RuntimeError('the worker loop failed')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=python_env(), capture_output=True, text=True,
                          timeout=90)  # fmt: skip
    assert done.returncode == 1 and "the worker loop failed" in done.stderr, done.stderr[-2000:]
