"""RocketMQ message queues as a stream source (the 4.x remoting client, package ``rocketmq`` 0.4.4).

URI: ``rocketmq://HOST:PORT[;HOST:PORT...]/TOPIC`` (name server addresses, ``;`` or ``,``
separated). Options whose names start with ``sr.`` are streamrover's; the others are client
settings named as RocketMQ's Java client names them: ``consumerGroup`` (default
``streamrover-TOPIC``: the group whose offsets are committed and, with ``sr.start=group``, read).

- ``sr.start``: where each queue starts when the dataset is registered: ``earliest`` (default:
  the queue's min offset), ``latest`` (its max offset) or ``group`` (the consumer group's
  committed offsets, earliest where none).
- ``sr.format``: ``raw`` (default: columns body, offset) or ``json`` (each body a JSON object;
  ``sr.schema`` such as ``id:int64,x:float64`` fixes the columns).
- ``sr.dead_letter_dir``: where records that fail to decode go, raw, one file per record
  named by partition and offset (idempotent on replay). Counts go to status.
- ``sr.read_timeout_ms``: how long a read retries an unreachable broker (default ``sr.missing_grace_ms``,
  as long as the master waits for a missing topic: a restart the master rides out does not stop a worker).

Partitions are message queues, named ``TOPIC@BROKER-QUEUEID``. Positions are queue offsets:
dense (every offset below a queue's max offset holds one message), so a shard ``[start, end)``
holds ``end - start`` records. ``poll()`` returns each queue's max offset as its end and its min
offset (read at most every second) as ``earliest``.

Why the 4.x client: the 5.x client (``rocketmq-python-client``) reads through the proxy's
gRPC API, whose PullMessage/QueryOffset/GetOffset answer UNIMPLEMENTED in 5.5, so it cannot
read by offset. Workers pull by offset with librocketmq (``Pull(queue, "*", offset, max)``)
against the name server; the master reads routes and queue offsets and commits the consumer
group's offsets with single remoting requests (:mod:`streamrover.sources.rocketmq_remoting`),
which librocketmq has no call for. The master leases a backlog in stream-time order by the store
time of each shard's first message (the broker's, not the producer's born time): one remoting
pull of that one message per shard (:meth:`RocketMQSource.first_times`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from streamrover.sources.api import (
    Partition,
    ReadBatch,
    Source,
    SourceDataLostError,
    SourceError,
    SourceGoneError,
    SourceKind,
    SourceUnavailableError,
    register_source,
)
from streamrover.sources.options import OptionError, RocketMQOptions, client_options
from streamrover.sources.rocketmq_remoting import (
    SUBSCRIPTION_GROUP_NOT_EXIST,
    QueueRoute,
    RemotingClient,
    RemotingConnectionError,
    RemotingError,
)
from streamrover.sources.serde import DeadLetters, Message, decode_json, parse_schema

RAW_SCHEMA = pa.schema([("body", pa.binary()), ("offset", pa.int64())])
CLIENT_OPTIONS = ("consumerGroup",)
DEFAULT_READ_TIMEOUT_MS = 60_000
MAX_BACKOFF = 2.0
MINS_EVERY = 1.0  # seconds between polls of the queues' min offsets (to see records deleted upstream)
_TOPIC_RE = re.compile(r"^[%|A-Za-z0-9_-]{1,127}$")
# librocketmq's CPullStatus
_FOUND, _NO_NEW_MSG, _NO_MATCHED_MSG, _OFFSET_ILLEGAL, _BROKER_TIMEOUT = range(5)


def librocketmq() -> Any:
    """``rocketmq.ffi`` (its ``dll``), the library loaded with ``RTLD_DEEPBIND`` first: call before any other use of
    the ``rocketmq`` package. librocketmq bundles libraries whose symbols TensorFlow also exports to the whole
    process; bound to those, its first send or pull crashes the process (SIGSEGV) wherever TensorFlow was
    imported before it (a TF trainer reading a topic). Deep-bound, it calls its own."""
    if "rocketmq.ffi" not in sys.modules and hasattr(os, "RTLD_DEEPBIND"):
        spec = importlib.util.find_spec("rocketmq")
        packaged = os.path.join(os.path.dirname(spec.origin), "librocketmq.so") if spec and spec.origin else ""
        path = packaged if os.path.exists(packaged) else ctypes.util.find_library("rocketmq")
        if path:  # the path rocketmq.ffi loads: its own load then finds this one
            ctypes.CDLL(path, mode=os.RTLD_DEEPBIND | os.RTLD_LOCAL)
    from rocketmq import ffi

    return ffi


def parse_uri(uri: str) -> tuple[list[str], str]:
    """``rocketmq://NS[;NS...]/TOPIC`` -> (name server addresses, topic)."""
    if not uri.startswith("rocketmq://"):
        raise SourceError(f"a RocketMQ URI looks like rocketmq://NAMESRV_HOST:PORT/TOPIC, got {uri!r}")
    servers, _, topic = uri[len("rocketmq://") :].partition("/")
    namesrvs = [s for s in re.split(r"[;,]", servers) if s]
    if not namesrvs or any(":" not in s for s in namesrvs) or not _TOPIC_RE.match(topic):
        raise SourceError(f"a RocketMQ URI looks like rocketmq://HOST:PORT[;HOST:PORT]/TOPIC, got {uri!r}")
    return namesrvs, topic


class RocketMQSource(Source):
    """A RocketMQ topic's message queues as a stream (``rocketmq://``; URI and options in the module docstring);
    positions are queue offsets (dense).
    """
    kind = SourceKind.STREAM
    dense_positions = True
    record_times = True  # store times: one remoting pull of one message per shard (first_times)

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        opts = dict(options or {})
        self.uri = uri
        self.namesrvs, self.topic = parse_uri(uri)
        self.options = RocketMQOptions.parse(opts, "RocketMQ", **{"sr.format": format})  # before any I/O
        client = client_options(opts)
        unknown = sorted(set(client) - set(CLIENT_OPTIONS))
        if unknown:
            raise OptionError(f"unknown RocketMQ option(s) {unknown}; known: {', '.join(CLIENT_OPTIONS)} and sr.*")
        self.group = client.get("consumerGroup", f"streamrover-{self.topic}")
        self.start = self.options.start
        self.format = self.options.format
        self._schema = RAW_SCHEMA if self.format == "raw" else parse_schema(self.options.record_schema)
        self._dead = DeadLetters(self.options.dead_letter_dir)
        self.read_timeout = self.options.read_timeout_s
        self._remoting: RemotingClient | None = None
        self._routes: dict[str, QueueRoute] = {}
        self._starts: dict[str, int] = {}  # queue min offsets seen by poll(): only new queues need one
        self._mins: dict[str, int] = {}  # queue min offsets now (records before them were deleted upstream)
        self._mins_at = -MINS_EVERY  # monotonic time of the last refresh of _mins
        self._group_registered = False
        self._puller: _Puller | None = None

    # -- master side: routes, offsets, commits (remoting) -----------------------------
    def _client(self) -> RemotingClient:
        if self._remoting is None:
            self._remoting = RemotingClient()
        return self._remoting

    def _pid(self, route: QueueRoute) -> str:
        return f"{self.topic}@{route.broker_name}-{route.queue_id}"

    def _route(self, partition_id: str) -> QueueRoute:
        if partition_id not in self._routes:
            self._queues()
        route = self._routes.get(partition_id)
        if route is None:
            raise SourceError(f"partition {partition_id!r} is not a message queue of topic {self.topic!r}")
        return route

    def _queues(self) -> list[QueueRoute]:
        """The topic's readable queues, from the first name server that answers."""
        errors = []
        for namesrv in self.namesrvs:
            try:
                queues = self._client().topic_route(namesrv, self.topic)
            except RemotingConnectionError as exc:
                errors.append(str(exc))
                continue
            except RemotingError as exc:
                raise SourceUnavailableError(f"name server {namesrv}: {exc}") from exc
            if queues is None:
                raise SourceGoneError(f"RocketMQ topic {self.topic!r} does not exist (name server {namesrv})")
            if not queues:
                raise SourceUnavailableError(f"RocketMQ topic {self.topic!r} has no readable queue on a master broker")
            self._routes = {self._pid(q): q for q in queues}
            return queues
        raise SourceUnavailableError(f"no RocketMQ name server answers: {'; '.join(errors)}")

    def _offsets(self, queues: list[QueueRoute], which: str) -> dict[str, int]:
        client = self._client()
        out: dict[str, int] = {}
        try:
            for q in queues:
                if which == "min":
                    out[self._pid(q)] = client.min_offset(q.broker_address, self.topic, q.queue_id)
                elif which == "max":
                    out[self._pid(q)] = client.max_offset(q.broker_address, self.topic, q.queue_id)
                else:
                    committed = client.query_consumer_offset(q.broker_address, self.group, self.topic, q.queue_id)
                    if committed is not None:
                        out[self._pid(q)] = committed
        except (RemotingConnectionError, RemotingError) as exc:
            raise SourceUnavailableError(f"cannot read queue offsets of {self.topic!r}: {exc}") from exc
        return out

    def partitions(self) -> list[Partition]:
        queues = self._queues()
        ends = self._offsets(queues, "max")
        starts = self._offsets(queues, "max" if self.start == "latest" else "min")
        if self.start == "group":
            starts.update(self._offsets(queues, "group"))
        return [Partition(pid, starts[pid], max(ends[pid], starts[pid])) for pid in (self._pid(q) for q in queues)]

    def poll(self) -> list[Partition]:
        queues = self._queues()
        ends = self._offsets(queues, "max")
        new = [q for q in queues if self._pid(q) not in self._starts]
        if new or time.monotonic() - self._mins_at >= MINS_EVERY:  # (one request per queue: not every poll)
            self._mins.update(self._offsets(queues, "min"))
            self._mins_at = time.monotonic()
        for q in new:
            self._starts[self._pid(q)] = self._mins[self._pid(q)]
        pids = [self._pid(q) for q in queues]
        return [Partition(pid, self._starts[pid], ends[pid], earliest=self._mins.get(pid)) for pid in pids]

    def commit(self, positions: Mapping[str, int]) -> None:
        for pid, offset in sorted(positions.items()):
            route = self._route(pid)
            try:
                self._commit_one(route, offset)
            except RemotingConnectionError as exc:
                raise SourceUnavailableError(f"cannot commit offsets of group {self.group!r}: {exc}") from exc

    def _commit_one(self, route: QueueRoute, offset: int) -> None:
        client = self._client()
        try:
            client.update_consumer_offset(route.broker_address, self.group, self.topic, route.queue_id, offset)
            return
        except RemotingError as exc:
            if exc.code != SUBSCRIPTION_GROUP_NOT_EXIST or self._group_registered:
                raise SourceError(f"cannot commit offsets of group {self.group!r}: {exc}") from exc
        # A group comes into being with its first consumer's heartbeat (where the broker auto-creates groups).
        self._group_registered = True
        client.register_consumer_group(route.broker_address, f"streamrover@{os.getpid()}", self.group)
        try:
            client.update_consumer_offset(route.broker_address, self.group, self.topic, route.queue_id, offset)
        except RemotingError as exc:
            raise SourceError(
                f"cannot commit offsets of group {self.group!r}: {exc}; create the group "
                f"(mqadmin updateSubGroup -g {self.group}) or enable autoCreateSubscriptionGroup"
            ) from exc

    def first_times(self, shards: Sequence[tuple[str, int, int]]) -> list[float | None]:
        """The broker's store time of each shard's first message: one PULL_MESSAGE of one message (remoting),
        which commits nothing."""
        out: list[float | None] = []
        try:
            for pid, start, end in shards:
                route = self._route(pid)
                got = self._client().store_time(route.broker_address, self.group, self.topic, route.queue_id, start)
                out.append(float(got[1]) if got is not None and start <= got[0] < end else None)
        except (RemotingConnectionError, RemotingError) as exc:
            raise SourceUnavailableError(f"cannot read store times of {self.topic!r}: {exc}") from exc
        return out

    def committed(self) -> dict[str, int | None]:
        """The consumer group's committed offset of each queue (None where it has none)."""
        queues = self._queues()
        got = self._offsets(queues, "group")
        return {self._pid(q): got.get(self._pid(q)) for q in queues}

    def schema(self) -> pa.Schema:
        return self._schema

    # -- worker side: pull by offset (librocketmq) --------------------------------------
    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        topic, _, rest = partition.id.partition("@")
        broker, _, qid = rest.rpartition("-")
        if topic != self.topic or not broker or not qid.isdigit():
            raise SourceError(f"partition {partition.id!r} is not a message queue of topic {self.topic!r}")
        if self._puller is None:
            self._puller = _Puller.shared(self.namesrvs, self.group)
        pending: list[tuple[int, bytes]] = []
        batch_start = offset = start
        while offset < end:
            fetched, offset = self._puller.pull(partition.id, broker, int(qid), offset, end, self.read_timeout)
            for msg in fetched:
                pending.append(msg)
                if len(pending) >= batch_size:
                    batch = self._batch(partition.id, pending, batch_start, msg[0] + 1)
                    batch_start, pending = batch.end, []
                    yield batch
        if pending or batch_start < end:
            yield self._batch(partition.id, pending, batch_start, end)

    def _batch(self, partition_id: str, msgs: list[tuple[int, bytes]], start: int, end: int) -> ReadBatch:
        offsets = pa.array([off for off, _ in msgs], pa.int64())
        if self.format == "raw":
            records = pa.RecordBatch.from_arrays(
                [pa.array([b for _, b in msgs], pa.binary()), offsets], schema=RAW_SCHEMA
            )
            return ReadBatch(records, start, end, offsets)
        decoded = [Message(off, body) for off, body in msgs]
        records, positions, dead = decode_json(decoded, self._schema, partition_id, self._dead)
        return ReadBatch(records, start, end, positions, dead_letters=dead)

    def close(self) -> None:
        if self._puller is not None:
            self._puller.release()
            self._puller = None
        if self._remoting is not None:
            self._remoting.close()
            self._remoting = None


class _Puller:
    """librocketmq's pull consumer, driven with explicit offsets (no offset store, no rebalance).

    One per process and (name servers, group), shared by the sources that read with it (:meth:`shared`,
    :meth:`release`): librocketmq refuses a second consumer of a group in a process ("has been created before"),
    so two workers' sources in one process (threads), or two datasets of one topic, could not both read.
    """

    _lock = threading.Lock()
    _shared: dict[tuple[str, str], tuple[_Puller, int]] = {}  # (name servers, group) -> (puller, users)

    @classmethod
    def shared(cls, namesrvs: list[str], group: str) -> _Puller:
        key = (";".join(namesrvs), group)
        with cls._lock:
            puller, users = cls._shared.get(key) or (cls(namesrvs, group), 0)
            cls._shared[key] = (puller, users + 1)
            return puller

    def release(self) -> None:
        """One user less; the last one shuts the consumer down."""
        with self._lock:
            puller, users = self._shared.pop(self._key)
            if users > 1:
                self._shared[self._key] = (puller, users - 1)
                return
        self.close()

    def __init__(self, namesrvs: list[str], group: str) -> None:
        self._key = (";".join(namesrvs), group)
        self._pulling = threading.Lock()  # one Pull at a time on the shared handle
        ffi = librocketmq()  # lazily
        dll = ffi.dll
        self._dll, self._mq_type = dll, ffi._CMessageQueue
        # MQMessage::getBody() returns the body as a std::string (binary-safe); the C API's
        # GetMessageBody returns a char* and cuts a body at its first NUL byte.
        self._get_body = dll._ZNK8rocketmq9MQMessage7getBodyEv
        self._get_body.argtypes = [ctypes.c_void_p]
        self._get_body.restype = ctypes.c_void_p
        self._body_checked = False
        self._handle = dll.CreatePullConsumer(group.encode())
        if not self._handle:
            raise SourceError("librocketmq could not create a pull consumer")
        dll.SetPullConsumerNameServerAddress(self._handle, ";".join(namesrvs).encode())
        if dll.StartPullConsumer(self._handle) != 0:
            raise SourceUnavailableError(f"librocketmq pull consumer did not start: {dll.GetLatestErrorMessage()!r}")
        # A started pull consumer's native threads keep the process from exiting until it is shut down: a
        # worker whose loop raised (never closing its source) hung at exit and was never restarted. Shut it
        # down at close() or, failing that, when the object goes or the interpreter exits.
        self._shutdown = weakref.finalize(self, _shutdown_consumer, dll, self._handle)

    def pull(
        self, pid: str, broker: str, queue_id: int, offset: int, end: int, timeout: float
    ) -> tuple[list[tuple[int, bytes]], int]:
        """Messages at ``offset`` onwards below ``end`` (one pull) and the next offset to pull."""
        mq = self._mq_type(topic=pid.partition("@")[0].encode(), brokerName=broker.encode(), queueId=queue_id)
        give_up, backoff = time.monotonic() + timeout, 0.05
        while True:
            with self._pulling:
                res = self._dll.Pull(self._handle, ctypes.byref(mq), b"*", offset, min(end - offset, 1024))
            try:
                status = res.pullStatus
                if status == _FOUND:
                    msgs = [self._message(res.msgFoundList[i]) for i in range(res.size)]
                    return [m for m in msgs if offset <= m[0] < end], max(int(res.nextBeginOffset), offset + 1)
                if status == _OFFSET_ILLEGAL and res.minOffset > offset:
                    gone = f"{pid} offsets from {offset} are gone from RocketMQ (min offset {res.minOffset})"
                    raise SourceDataLostError(gone)
                what = f"pull status {status} at {pid} offset {offset} (queue max offset {res.maxOffset})"
            finally:
                self._dll.ReleasePullResult(res)
            # Broker unreachable or restarting, or the offset not visible yet: retry with backoff.
            if time.monotonic() + backoff > give_up:
                raise SourceUnavailableError(f"cannot read {pid} below {end}: {what} for {timeout:.0f}s")
            time.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _message(self, handle: int) -> tuple[int, bytes]:
        string = self._get_body(handle)  # a libstdc++ (pre-C++11 ABI) std::string: one pointer to the chars,
        data = ctypes.c_void_p.from_address(string).value or 0  # with the length 24 bytes before them
        body = ctypes.string_at(data, ctypes.c_size_t.from_address(data - 24).value) if data else b""
        if not self._body_checked:
            if body.split(b"\0", 1)[0] != (self._dll.GetMessageBody(handle) or b""):
                raise SourceError("librocketmq's message body layout is not the one this source reads (rocketmq 0.4.4)")
            self._body_checked = True
        return int(self._dll.GetMessageQueueOffset(handle)), body

    def close(self) -> None:
        self._shutdown()  # (once: later calls do nothing)


def _shutdown_consumer(dll: Any, handle: Any) -> None:
    dll.ShutdownPullConsumer(handle)
    dll.DestroyPullConsumer(handle)


def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return RocketMQSource(uri, format, options)


register_source(_factory, schemes=("rocketmq",))
