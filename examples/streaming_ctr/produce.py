"""Write the click stream to a Kafka topic at a set rate: keyed by user, the event time in each record.

``python -m examples.streaming_ctr.produce --bootstrap HOST:PORT --topic clicks --records N --rate R``
creates the topic (``--partitions``) if it is missing and sends records ``0 .. N-1`` paced at ``R``
records per second; each record's ``event_ms`` is the wall-clock time it is handed to the client.
``--progress FILE`` receives a JSON progress document about once a second (sent, delivered,
when the first record of each drift regime was sent). ``-X key=value`` passes librdkafka
settings through.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from examples.streaming_ctr.clickstream import ClickStream


def ensure_topic(bootstrap: str, topic: str, partitions: int, config: dict[str, Any] | None = None) -> None:
    """Create ``topic`` with ``partitions`` partitions unless it exists."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, **(config or {})})
    if topic in admin.list_topics(timeout=30).topics:
        return
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(30)


class Progress:
    """What the producer did so far, written atomically to a JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"sent": 0, "delivered": 0, "failed": 0, "started": time.time(), "drift_sent": {},
                                    "done": False}  # fmt: skip

    def write(self, every: float = 0.0) -> None:
        """Write the file (``every``: unless it was written less than that many seconds ago)."""
        if self.path is None or time.time() - self.doc.get("written", 0.0) < every:
            return
        self.doc["written"] = time.time()  # a reader tells a stalled producer from a slow one
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.doc))
        tmp.replace(self.path)


def produce(bootstrap: str, topic: str, stream: ClickStream, records: int, rate: float, partitions: int,
            config: dict[str, Any] | None = None, progress: Progress | None = None, chunk: int = 256,
            start: int = 0) -> Progress:
    """Send records ``start .. records-1`` at ``rate`` per second; returns once every one is delivered.

    Records are keyed by user; a user's records all go to one partition (``ClickStream.partition_of``),
    so they stay in order. The last record of each partition is sent alone, after everything else
    is delivered: it is then a batch of its own, which makes the end of the stream visible on
    brokers whose high watermark trails the last batch (tansu: see tests/brokers/tansu.py) while
    every other record is batched (``linger.ms``).
    """
    from confluent_kafka import Producer

    progress = progress or Progress(None)
    doc = progress.doc
    settings: dict[str, Any] = {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5, **(config or {})}
    producer = Producer(settings)

    def delivered(err: Any, _msg: Any) -> None:
        doc["failed" if err is not None else "delivered"] += 1

    users = stream.columns(start, records)["user"] if records > start else np.empty(0, np.int64)
    part = np.concatenate([np.zeros(start, np.int64), stream.partition_of(users, partitions)])  # by id
    tail = {start + int(np.flatnonzero(part[start:] == p)[-1]) for p in range(partitions) if np.any(part[start:] == p)}
    held: list[tuple[int, bytes, int]] = []

    def send(body: bytes, user: int, p: int) -> None:
        while True:
            try:
                producer.produce(topic, value=body, key=str(user).encode(), partition=p, on_delivery=delivered)
                return
            except BufferError:  # the client's queue is full: let it drain
                doc["queue_full"] = doc.get("queue_full", 0) + 1
                producer.poll(0.05)
                progress.write(every=1.0)

    drifts = list(stream.hidden.drift_at)
    t0 = time.monotonic()
    doc["started"], written = time.time(), 0.0
    sent = start
    while sent < records:
        due = min(records, start + int((time.monotonic() - t0) * rate) + 1)
        if due <= sent:
            wait = (sent - start + 1) / rate - (time.monotonic() - t0)
            producer.poll(min(wait, 0.05))  # pace: serve callbacks meanwhile
            continue
        stop = min(due, sent + chunk)
        cols = stream.columns(sent, stop)
        now = time.time()
        bodies = stream.json_records(cols, np.full(stop - sent, int(now * 1000), dtype=np.int64))
        for i, user, body in zip(range(sent, stop), cols["user"].tolist(), bodies):
            if i in tail:
                held.append((user, body, int(part[i])))
            else:
                send(body, user, int(part[i]))
        for d in drifts:
            if sent <= d < stop:
                doc["drift_sent"][str(d)] = now
        sent = stop
        doc["sent"] = sent - len(held)
        producer.poll(0)
        if time.time() - written >= 1.0:
            progress.write()
            written = time.time()
    remaining = _flush(producer, progress, 120)
    for user, body, p in held:  # each partition's last record, alone in its batch
        send(body, user, p)
        remaining += _flush(producer, progress, 60)
    doc["sent"] = sent
    doc["done"], doc["finished"] = remaining == 0 and doc["failed"] == 0, time.time()
    progress.write()
    if remaining or doc["failed"]:
        raise RuntimeError(f"{remaining} records undelivered and {doc['failed']} failed out of {records}")
    return progress


def _flush(producer: Any, progress: Progress, timeout: float) -> int:
    """``producer.flush(timeout)``, writing the progress file each second meanwhile; returns what is undelivered."""
    deadline = time.monotonic() + timeout
    while (remaining := int(producer.flush(min(1.0, max(0.0, deadline - time.monotonic()))))) and (
        time.monotonic() < deadline
    ):
        progress.write(every=1.0)
    return remaining


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", required=True, help="bootstrap.servers")
    p.add_argument("--topic", default="clicks")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--start", type=int, default=0, help="the first record's id (those before it are sent already)")
    p.add_argument("--rate", type=float, default=1000.0, help="records per second")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--drift-at", type=int, nargs="*", default=[], help="record ids where the hidden model changes")
    p.add_argument("--progress", default=None, help="a JSON file for progress")
    p.add_argument("-X", dest="config", action="append", default=[], metavar="KEY=VALUE", help="librdkafka setting")
    args = p.parse_args(argv)
    config = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"-X {item!r}: expected KEY=VALUE")
        config[key] = value
    ensure_topic(args.bootstrap, args.topic, args.partitions)
    progress = Progress(Path(args.progress) if args.progress else None)
    produce(args.bootstrap, args.topic, ClickStream(args.seed, tuple(args.drift_at)), args.records, args.rate,
            args.partitions, config, progress, start=args.start)  # fmt: skip
    print(json.dumps(progress.doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
