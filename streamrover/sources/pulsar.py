"""Pulsar topic partitions as a stream source (pulsar-client).

URI: ``pulsar://HOST:PORT[,HOST:PORT...]/[TENANT/NAMESPACE/]TOPIC`` (``pulsar+ssl://`` too); the
topic defaults to ``persistent://public/default/TOPIC``. Each partition of a partitioned topic is a
partition of the dataset, named by its local topic name (``TOPIC-partition-N``); a non-partitioned
topic is one partition named ``TOPIC``. Options whose names start with ``sr.`` are streamrover's;
every other option is a ``pulsar.Client`` keyword argument, passed through (values ``true``/``false``
and numbers are converted): ``operation_timeout_seconds``, ``tls_trust_certs_file_path``, ...

- ``sr.start``: ``earliest`` (default: the first message still stored) or ``latest``.
- ``sr.format``/``sr.schema``/``sr.dead_letter_dir``: as for Kafka (``raw`` columns: key, value,
  timestamp, position, batch_index; ``json`` objects decoded into ``sr.schema``; records that fail to
  decode go raw to one file each, named by partition, position and batch index: idempotent on replay).
- ``sr.subscription``: the durable subscription the committed cursor is acknowledged on
  (default ``streamrover-TOPIC``). It is created, from the earliest message, when the dataset is
  registered, so retention keeps what is not committed yet; it is only acknowledged (cumulatively)
  in :meth:`PulsarSource.commit`, i.e. after a checkpoint's cut was committed. Reads never use it.
- ``sr.partition_reads``: ``direct``, ``routed`` or ``auto`` (default), see below.
- ``sr.entry_bits`` (default 24) and ``sr.read_timeout_ms`` (default ``sr.missing_grace_ms``: a shard read that gets
  no message for this long fails with :class:`SourceUnavailableError`).
- ``sr.reopen_ms`` (default 500): a shard read whose reader delivers nothing for this long opens a
  new reader where it stopped (the shard's messages exist: its end was polled). pulsar-lite 0.2.0's
  readers and consumers stop delivering a backlog at random points and never resume (measured
  with receiver queues of 100 and 1000, partitioned topics or not, readers, Shared and Exclusive
  consumers; queues of 1-10 did not stall in one run but read at 3.5k-12k messages/s); a new
  reader at the same position goes on. ``sr.receiver_queue_size`` (default 1000): the readers'
  receiver queue (never more than the shard's size). The master's ``routed`` tail reader has no
  such remedy yet: on pulsar-lite it can stop short, and planning then waits.

**Position model.** A message id is (ledger id, entry id, batch index). A position is the *entry*:
``position = ledger_id << ENTRY_BITS | entry_id`` with ``ENTRY_BITS = sr.entry_bits`` (16..40), so
ledger ids get ``63 - ENTRY_BITS`` bits (39 by default: 5.5e11 ledgers) and a ledger up to
``2**ENTRY_BITS`` entries (16.7M by default; real Pulsar can exceed its 50000 entries per ledger
when a ledger fills before ``managedLedgerMinLedgerRolloverTimeMinutes``). An id that does not fit
raises :class:`SourceError` naming the option to change. Positions are ordered like message ids
(ledgers of one topic have increasing ids; BookKeeper entries of a ledger are dense) and are dense
inside a ledger; a ledger rollover is a gap. The messages of one batched entry share its position:
a read batch, a shard boundary and an ack never split an entry (ack and cursor granularity is the
entry, as is a Pulsar subscription's mark-delete position), so a read batch may exceed ``batch_size``
by the rest of one entry. For non-batched producers a position is a message and ``records_per_shard``
counts messages; with batching it counts entries. Reads skip duplicate deliveries by
(position, batch index), which only grows along a partition. Partitions with no message yet are
not reported until their first message exists (their first ledger id is not known before).
The master side reports each ledger it has seen as a run (``Partition.segments``) so that shards,
lag and counts are sized in records: ``routed`` sees every message; ``direct`` learns the newest
ledger from ``get_last_message_id`` and, after a rollover, reads the tail of the ledgers before it
(from the entry after the last one known: the broker moves such a start to the next ledger).
The master leases a backlog in stream-time order by each shard's first message's publish time (set by
the producer at send): a reader opened at the shard's start reads one message (:meth:`PulsarSource.first_times`).

**Reading one partition.** ``direct`` opens a reader (and, on the master, a consumer of the
subscription) on the partition's own topic ``persistent://.../TOPIC-partition-N``: the right way on
real Apache Pulsar. pulsar-lite answers a partition's name as another partitioned topic, so
``routed`` reads the partitioned topic from the shard's start message id and keeps the messages whose
``topic_name()`` is the wanted partition; its master side tails the whole topic to learn each
partition's last message id (``get_last_message_id`` is not supported on a multi-topic consumer)
and acknowledges through one consumer of the partitioned topic. ``auto`` asks the broker for the
partitions of ``TOPIC-partition-0``: a broker that answers the partition itself gets ``direct``,
others ``routed`` (on pulsar-lite that lookup creates a topic ``TOPIC-partition-0``). Tested here
against pulsar-lite 0.2.0 (tests/sources/test_pulsar_stream.py: partitioned topics ``routed``, a
non-partitioned topic ``direct``; pulsar-lite never rolls a ledger) and real Apache Pulsar 4.0
standalone with 50-entry ledgers (tests/sources/test_pulsar_rollover.py: a partitioned topic read
``direct`` across ledger rollovers). Batched producers are written to the client API but not tested.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import pulsar
import pyarrow as pa

from streamrover.sources.api import (
    Partition,
    ReadBatch,
    Source,
    SourceGoneError,
    SourceKind,
    SourceUnavailableError,
    register_source,
)
from streamrover.sources.options import OptionError, PulsarOptions, client_options
from streamrover.sources.pulsar_client import RAW_SCHEMA, client_logger, first_time, parse_uri, raw_batch
from streamrover.sources.pulsar_client import client_value as _client_value
from streamrover.sources.pulsar_client import partition_index as _index
from streamrover.sources.pulsar_positions import LedgerRuns, PositionCodec
from streamrover.sources.serde import DeadLetters, Message, decode_json, parse_schema

log = logging.getLogger(__name__)
POLL_BUDGET = 0.5  # seconds a routed poll may spend tailing the topic
REGISTER_BUDGET = 60.0  # ... and the first listing, which reads up to the end


class PulsarSource(Source):
    """A Pulsar topic's partitions as a stream (``pulsar://``; URI and options in the module docstring); positions
    are sparse (ledger and entry ids: :mod:`.pulsar_positions`).
    """
    kind = SourceKind.STREAM
    dense_positions = False
    record_times = True  # publish times (first_times)

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        opts = dict(options or {})
        self.uri = uri
        self.service_url, self.topic = parse_uri(uri)
        self.prefix = self.topic.rsplit("/", 1)[0] + "/"
        o = self.options = PulsarOptions.parse(opts, "Pulsar", **{"sr.format": format})  # before any I/O
        self.client_options = {k: _client_value(v) for k, v in client_options(opts).items()}
        self.client_options.setdefault("operation_timeout_seconds", 10)
        allowed = set(inspect.signature(pulsar.Client).parameters) - {"service_url", "logger"}  # those are ours
        unknown = sorted(set(self.client_options) - allowed)
        if unknown:
            raise OptionError(f"unknown Pulsar client option(s) {unknown}: options other than sr.* are pulsar.Client "
                              "arguments (operation_timeout_seconds, io_threads, ...)")  # fmt: skip
        self.subscription = o.subscription or f"streamrover-{self.topic.rsplit('/', 1)[1]}"
        self.codec = PositionCodec(o.entry_bits)
        self.read_timeout = o.read_timeout_s
        self.reopen_after = o.reopen_ms / 1000.0
        self.receiver_queue = o.receiver_queue_size
        self.mode = o.partition_reads
        self.start_mode = o.start
        self.format = o.format
        self._schema = RAW_SCHEMA if self.format == "raw" else parse_schema(o.record_schema)
        self._dead = DeadLetters(o.dead_letter_dir)
        self._client: Any = None
        self._names: list[str] = []  # full topic names of the partitions, in partition order
        self._consumers: dict[str, Any] = {}  # direct: per partition; routed: "" -> one on the topic
        self._tail: Any = None  # routed master side: a reader of the whole topic
        self._first: dict[str, int] = {}  # partition id -> position of the first message seen
        self._last: dict[str, int] = {}  # partition id -> position of the last message seen
        self._acked: dict[str, int] = {}  # partition id -> position last committed upstream
        self._empty: dict[str, tuple[int, int]] = {}  # partition id -> [a, b) known to hold no message
        self._ledgers = LedgerRuns(self.codec.entry_bits)  # master side: the ledgers seen, per partition
        self._walkers: dict[str, Any] = {}  # direct master side: readers learning ledgers (``_walk``)
        self._walked: dict[str, tuple[int, int]] = {}  # ... and the (ledger, entry) up to which they are known

    # -- clients and names -----------------------------------------------------
    def _pulsar(self) -> Any:
        if self._client is None:
            self._client = pulsar.Client(self.service_url, logger=client_logger(), **self.client_options)
        return self._client

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except pulsar.TopicNotFound as exc:
            raise SourceGoneError(f"Pulsar topic {self.topic!r} does not exist at {self.service_url}") from exc
        except pulsar.PulsarException as exc:
            raise SourceUnavailableError(f"Pulsar at {self.service_url}: {what} failed: {exc!r}") from exc

    def _partition_names(self) -> list[str]:
        names = sorted(self._call("partition lookup", self._pulsar().get_topic_partitions, self.topic), key=_index)
        if self.mode == "auto":
            probe = self._call("partition lookup", self._pulsar().get_topic_partitions, names[0])
            self.mode = "direct" if probe == [names[0]] else "routed"
            log.info("Pulsar %s: %s partition reads", self.topic, self.mode)
        self._names = names
        return names

    def _pid(self, name: str) -> str:
        return name[len(self.prefix) :] if name.startswith(self.prefix) else name

    def _full(self, partition_id: str) -> str:
        return self.prefix + partition_id

    def _message_id(self, partition_id: str, position: int) -> Any:
        ledger, entry = self.codec.decode(position)
        mid = pulsar.MessageId(_index(self._full(partition_id)), ledger, entry, -1)
        return pulsar.MessageId.deserialize(mid.serialize(), topic=self._full(partition_id))

    def _position(self, msg: Any) -> tuple[int, int]:
        mid = msg.message_id()
        return self.codec.encode(mid.ledger_id(), mid.entry_id()), mid.batch_index()

    def _consumer(self, name: str) -> Any:
        if name not in self._consumers:
            self._consumers[name] = self._call(
                f"subscribing {self.subscription!r}",
                self._pulsar().subscribe,
                name or self.topic,
                self.subscription,
                consumer_type=pulsar.ConsumerType.Failover,
                initial_position=pulsar.InitialPosition.Earliest,
                receiver_queue_size=1,
            )
        return self._consumers[name]

    # -- master side ---------------------------------------------------------------
    def _scan(self, budget: float = POLL_BUDGET) -> None:
        """Update ``_first``/``_last`` and the ledgers seen from the broker."""
        names = self._partition_names()
        if self.mode == "routed":
            self._consumer("")  # the subscription exists from the registration on
            self._scan_routed(budget)
            return
        deadline = time.monotonic() + budget
        for name in names:
            pid = self._pid(name)
            last = self._call("get_last_message_id", self._consumer(name).get_last_message_id)
            if last.entry_id() < 0:
                continue  # no message yet
            ledger, entry = last.ledger_id(), last.entry_id()
            self._last[pid] = self.codec.encode(ledger, entry)
            if pid not in self._first:
                reader = self._call("create_reader", self._pulsar().create_reader, name, pulsar.MessageId.earliest)
                try:
                    self._first[pid] = self._position(self._call("read", reader.read_next, 10_000))[0]
                finally:
                    reader.close()
                self._ledgers.see(pid, *self.codec.decode(self._first[pid]))
                self._walked[pid] = self._walk_start(pid, name)
            if self._walk(pid, name, ledger, deadline):
                self._walked[pid] = (ledger, entry)
            first_ledger, first_entry = self.codec.decode(self._first[pid])
            self._ledgers.see(pid, ledger, first_entry if ledger == first_ledger else 0, entry)  # entries are dense

    def _walk_start(self, pid: str, name: str) -> tuple[int, int]:
        """Where learning ledgers starts: just before the subscription's first unacknowledged message.

        What lies before it was committed, so the master knows its runs from its journal (a restarted
        master's source need not walk the retained history again). A fresh subscription starts at
        the first message; one with nothing to deliver within 5 s starts at the first message too.
        """
        first = self.codec.decode(self._first[pid])
        try:
            msg = self._consumer(name).receive(5000)  # not acknowledged: delivered again to the next consumer
        except pulsar.Timeout:
            return first
        except pulsar.PulsarException as exc:
            raise SourceUnavailableError(f"Pulsar at {self.service_url}: receiving from {pid}: {exc!r}") from exc
        ledger, entry = self.codec.decode(self._position(msg)[0])
        return max(first, (ledger, entry - 1))

    def _walk(self, pid: str, name: str, ledger: int, deadline: float) -> bool:
        """Learn the ledgers before ``ledger`` not seen whole yet. Returns whether every one is known now.

        Reads from the entry after the last one walked (the broker moves a start past a ledger's
        end to the next ledger) until the first message of ``ledger``: the tail of the ledger seen
        last, and any between; within the poll's budget, the reader kept for the next poll.
        Normally a rollover costs the entries written since the last poll.
        """
        while self._walked[pid][0] < ledger:
            if time.monotonic() >= deadline:
                return False
            walker = self._walkers.get(pid)
            if walker is None:
                at, last = self._walked[pid]
                start = self._message_id(pid, self.codec.encode(at, last + 1))
                walker = self._call(
                    "create_reader", self._pulsar().create_reader, name, start, start_message_id_inclusive=True
                )
                self._walkers[pid] = walker
            try:
                msg = walker.read_next(200)
            except pulsar.Timeout:
                continue  # the entries exist (a later ledger holds the last message): a slow broker, wait on
            except pulsar.PulsarException as exc:
                self._walkers.pop(pid).close()
                raise SourceUnavailableError(f"Pulsar at {self.service_url}: reading {pid}: {exc!r}") from exc
            seen, entry = self.codec.decode(self._position(msg)[0])
            if seen >= ledger:
                self._walkers.pop(pid).close()
                return True
            self._ledgers.see(pid, seen, entry)
            self._walked[pid] = max(self._walked[pid], (seen, entry))
        return True

    def _scan_routed(self, budget: float) -> None:
        if self._tail is None:
            self._tail = self._call(
                "create_reader", self._pulsar().create_reader, self.topic, pulsar.MessageId.earliest
            )
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            try:
                msg = self._tail.read_next(50)
            except pulsar.Timeout:
                return
            except pulsar.PulsarException as exc:
                self._tail = None
                raise SourceUnavailableError(f"Pulsar at {self.service_url}: tailing {self.topic}: {exc!r}") from exc
            pid, pos = self._pid(msg.topic_name()), self._position(msg)[0]
            self._first.setdefault(pid, pos)
            self._last[pid] = max(self._last.get(pid, pos), pos)
            self._ledgers.see(pid, *self.codec.decode(pos))

    def _polled(self) -> list[Partition]:
        out = []
        for name in self._names:
            pid = self._pid(name)
            if pid in self._last:
                segments = self._ledgers.runs(pid)  # every ledger seen: the master counts records by them
                out.append(Partition(pid, self._first[pid], self._last[pid] + 1, segments=segments))
        return out

    def partitions(self) -> list[Partition]:
        self._scan(budget=REGISTER_BUDGET)  # routed: catch up with the topic, so that ``latest`` is the end now
        polled = self._polled()
        if self.start_mode == "latest":
            return [Partition(p.id, p.end, p.end) for p in polled]
        return polled

    def poll(self) -> list[Partition]:
        self._scan()
        return self._polled()

    def commit(self, positions: Mapping[str, int]) -> None:
        """Cumulatively acknowledge, on the subscription, the entry before each position.

        A position at entry 0 of a ledger names no earlier entry of this topic (the previous
        ledger's id is not known): nothing is acknowledged until a later position commits.
        """
        if not self._names:
            self._partition_names()
        for pid, pos in sorted(positions.items()):
            ledger, entry = self.codec.decode(pos)
            if entry == 0 or self._acked.get(pid, -1) >= pos:
                continue
            consumer = self._consumer("" if self.mode == "routed" else self._full(pid))
            mid = self._message_id(pid, self.codec.encode(ledger, entry - 1))
            self._call(f"acknowledging {pid} up to {pos}", consumer.acknowledge_cumulative, mid)
            self._ledgers.forget_before(pid, ledger)  # the master folded the runs below (RecordRuns.compact)
            self._acked[pid] = pos

    def first_times(self, shards: Sequence[tuple[str, int, int]]) -> list[float | None]:
        """Each shard's first message's publish time: a reader opened at the shard's start reads one message (None,
        without a read, for a range past the last message polled)."""
        if not self._names:
            self._partition_names()
        wait = min(self.read_timeout, 10.0)
        position = lambda msg: self._position(msg)[0]  # noqa: E731
        return [
            first_time(partial(self._reader_at, pid, a, 1), self._full(pid), position, a, b, wait)
            if a <= self._last.get(pid, -1) else None
            for pid, a, b in shards
        ]

    def schema(self) -> pa.Schema:
        return self._schema

    def _reader_at(self, pid: str, position: int, queue: int) -> Any:
        """A reader of partition ``pid`` from ``position`` on (routed: of the partitioned topic)."""
        topic = self._full(pid) if self.mode == "direct" else self.topic
        return self._call(f"reading {pid}", self._pulsar().create_reader, topic, self._message_id(pid, position),
                          start_message_id_inclusive=True, receiver_queue_size=queue)  # fmt: skip

    # -- worker side -------------------------------------------------------------------
    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        known = self._empty.get(partition.id)
        if start >= end or (known is not None and known[0] <= start and end <= known[1]):
            return  # nothing there (a ledger rollover gap): the client completes the shard
        if not self._names:
            self._partition_names()
        full = self._full(partition.id)

        def open_at(position: int) -> Any:
            return self._reader_at(partition.id, position, max(10, min(self.receiver_queue, end - position + 1)))

        holder = [open_at(start)]
        try:
            yield from self._read(holder, open_at, partition.id, full, start, end, batch_size)
        finally:
            holder[0].close()

    def _read(
        self, holder: list[Any], open_at: Any, pid: str, full: str, start: int, end: int, batch_size: int
    ) -> Iterator[ReadBatch]:
        """Read [start, end) from ``holder[0]``, re-opening it (in ``holder``) where it stopped when it stalls."""
        pending: list[tuple[Any, int, int]] = []  # (message, position, batch index)
        last = (start - 1, 1 << 31)  # (position, batch index) of the last kept message
        batch_start = start
        stalled_since = quiet_since = time.monotonic()
        while True:
            try:
                msg = holder[0].read_next(200)
            except pulsar.Timeout:
                if last[0] == end - 1:
                    break  # the shard's last entry came whole (an entry arrives at once)
                now = time.monotonic()
                if now - stalled_since > self.read_timeout:
                    raise SourceUnavailableError(
                        f"no message of {pid} in [{start}, {end}) for {self.read_timeout:.0f}s (read at {last[0] + 1})"
                    ) from None
                if now - quiet_since > self.reopen_after:
                    # The shard's records exist (its end was polled), yet none came: a reader that
                    # stopped delivering a backlog (pulsar-lite does). Open a new one where this one
                    # stopped (the entry of the last message kept: duplicates are skipped below).
                    holder[0].close()
                    holder[0] = open_at(max(last[0], start))
                    quiet_since = now
                continue
            except pulsar.PulsarException as exc:
                raise SourceUnavailableError(f"Pulsar at {self.service_url}: reading {pid}: {exc!r}") from exc
            stalled_since = quiet_since = time.monotonic()
            if msg.topic_name() != full:
                continue  # routed: another partition
            pos, bidx = self._position(msg)
            if (pos, bidx) <= last or pos < start:
                continue  # a duplicate delivery (or before the shard)
            if pos >= end:
                self._empty[pid] = (last[0] + 1, pos)
                break
            if pending and len(pending) >= batch_size and pos != pending[-1][1]:
                batch = self._batch(pid, pending, batch_start, pending[-1][1] + 1)
                batch_start, pending = batch.end, []
                yield batch
            pending.append((msg, pos, bidx))
            last = (pos, bidx)
            if pos == end - 1 and bidx < 0:
                break  # the shard's last entry, not batched
        if pending or batch_start < end:
            yield self._batch(pid, pending, batch_start, end)

    def _batch(self, pid: str, msgs: list[tuple[Any, int, int]], start: int, end: int) -> ReadBatch:
        if self.format == "raw":
            return raw_batch(msgs, start, end)
        decoded = [Message(pos, m.data() or b"", (m.partition_key() or "").encode(), bidx) for m, pos, bidx in msgs]
        records, kept, dead = decode_json(decoded, self._schema, pid, self._dead)
        return ReadBatch(records, start, end, kept, dead_letters=dead)

    def close(self) -> None:
        for closable in [*self._consumers.values(), *self._walkers.values(), self._tail]:
            if closable is not None:
                try:
                    closable.close()
                except pulsar.PulsarException as exc:  # already disconnected: nothing to release
                    log.debug("closing %s: %r", self.topic, exc)
        self._consumers, self._walkers, self._tail = {}, {}, None
        if self._client is not None:
            self._client.close()
            self._client = None


def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return PulsarSource(uri, format, options)


register_source(_factory, schemes=("pulsar",))
