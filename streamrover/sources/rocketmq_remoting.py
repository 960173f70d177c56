"""A small client for RocketMQ's remoting protocol: routes, queue offsets, consumer-group offsets.

The 4.x client library (``rocketmq`` 0.4.4, librocketmq) pulls messages by offset but has no
call to read a queue's offset range without fetching, nor to commit or query a consumer
group's offsets. Those are single request/response exchanges of the remoting protocol that
every RocketMQ client and ``mqadmin`` speak; this module speaks them, in pure Python.

Frame: ``int32 length | int32 (serialize type << 24 | header length) | JSON header | body``.
The header's ``extFields`` carry a request's arguments and a response's results; ``opaque``
matches a response to its request. One :class:`RemotingClient` keeps one connection per
address and serialises calls on it; any socket error closes that connection (the next call
reconnects) and raises :class:`RemotingConnectionError`.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

# org.apache.rocketmq.remoting.protocol.RequestCode
PULL_MESSAGE = 11
QUERY_CONSUMER_OFFSET = 14
UPDATE_CONSUMER_OFFSET = 15
GET_MAX_OFFSET = 30
GET_MIN_OFFSET = 31
HEART_BEAT = 34
GET_ROUTEINFO_BY_TOPIC = 105
# org.apache.rocketmq.remoting.protocol.ResponseCode
SUCCESS = 0
TOPIC_NOT_EXIST = 17
QUERY_NOT_FOUND = 22
SUBSCRIPTION_GROUP_NOT_EXIST = 26
PULL_NOT_FOUND = 19
PULL_RETRY_IMMEDIATELY = 20
PULL_OFFSET_MOVED = 21
# PullSysFlag.FLAG_SUBSCRIPTION: the request carries its subscription (no registered consumer needed)
_FLAG_SUBSCRIPTION = 1 << 2
# MessageSysFlag.BORNHOST_V6_FLAG: the born host is 16 + 4 bytes, not 4 + 4
_BORNHOST_V6 = 1 << 4

_RESPONSE_FLAG = 1
_MAX_FRAME = 64 * 1024 * 1024


class RemotingError(Exception):
    """A remoting call was answered with an error code; ``code`` and ``remark`` are the server's."""

    def __init__(self, code: int, remark: str | None, request: str) -> None:
        super().__init__(f"{request} failed: response code {code}: {remark}")
        self.code = code
        self.remark = remark


class RemotingConnectionError(Exception):
    """The server could not be reached or dropped the connection (it may be restarting)."""


@dataclass(frozen=True)
class Response:
    """A remoting response: its code, remark, extension fields and body."""
    code: int
    remark: str | None
    fields: dict[str, str]
    body: bytes

    def check(self, request: str) -> Response:
        """This response if it succeeded; :class:`RemotingError` naming ``request`` otherwise."""
        if self.code != SUCCESS:
            raise RemotingError(self.code, self.remark, request)
        return self


@dataclass(frozen=True)
class QueueRoute:
    """One message queue of a topic and the address of the master broker that serves it."""

    broker_name: str
    queue_id: int
    broker_address: str


def fastjson_loads(body: bytes) -> Any:
    """RocketMQ's fastjson writes maps with integer keys unquoted (``{0:"addr"}``): quote them, then parse."""
    text = body.decode("utf-8")
    return json.loads(re.sub(r'([{,])\s*(-?\d+)\s*:', r'\1"\2":', text))


class RemotingClient:
    """Request/response calls over one persistent TCP connection per ``host:port``."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._socks: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._opaque = itertools.count(1)

    def call(self, address: str, code: int, fields: dict[str, str] | None = None, body: bytes = b"") -> Response:
        """Send one request to ``address`` and return its response (whatever its code)."""
        with self._guard:
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            opaque = next(self._opaque)
            header = json.dumps({
                "code": code, "language": "PYTHON", "version": 500, "opaque": opaque, "flag": 0,
                "extFields": fields or {}, "serializeTypeCurrentRPC": "JSON",
            }).encode()
            frame = struct.pack(">II", 4 + len(header) + len(body), len(header)) + header + body
            try:
                sock = self._connect(address)
                sock.sendall(frame)
                while True:  # skip answers to requests that timed out earlier on this connection
                    resp, payload = self._receive(sock)
                    if resp.get("opaque") == opaque and resp.get("flag", 0) & _RESPONSE_FLAG:
                        break
            except OSError as exc:
                self._drop(address)
                raise RemotingConnectionError(f"RocketMQ remoting call {code} to {address} failed: {exc}") from exc
        ext = resp.get("extFields") or {}
        return Response(int(resp["code"]), resp.get("remark"), {str(k): str(v) for k, v in ext.items()}, payload)

    def close(self) -> None:
        """Close every connection (a later request connects again)."""
        with self._guard:
            for address in list(self._socks):
                self._drop(address)

    def _connect(self, address: str) -> socket.socket:
        sock = self._socks.get(address)
        if sock is None:
            host, _, port = address.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close()

    @staticmethod
    def _receive(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
        (length,) = struct.unpack(">I", _recv_exact(sock, 4))
        if not 4 <= length <= _MAX_FRAME:
            raise OSError(f"bad remoting frame length {length}")
        payload = _recv_exact(sock, length)
        (ori_header_len,) = struct.unpack(">I", payload[:4])
        if ori_header_len >> 24 != 0:
            raise OSError("the server answered in ROCKETMQ serialization; only JSON is supported")
        header_len = ori_header_len & 0xFFFFFF
        return json.loads(payload[4 : 4 + header_len]), payload[4 + header_len :]

    # -- calls --------------------------------------------------------------------------
    def topic_route(self, namesrv: str, topic: str) -> list[QueueRoute] | None:
        """The readable queues of ``topic`` on master brokers, from the name server; None if it has no route."""
        resp = self.call(namesrv, GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        if resp.code == TOPIC_NOT_EXIST:
            return None
        route = fastjson_loads(resp.check(f"GET_ROUTEINFO_BY_TOPIC {topic}").body)
        masters = {b["brokerName"]: b.get("brokerAddrs", {}).get("0") for b in route.get("brokerDatas", [])}
        queues = []
        for q in route.get("queueDatas", []):
            address = masters.get(q["brokerName"])
            if address is None or not int(q.get("perm", 6)) & 4:  # no master now, or not readable
                continue
            queues += [QueueRoute(q["brokerName"], i, address) for i in range(int(q["readQueueNums"]))]
        return sorted(queues, key=lambda r: (r.broker_name, r.queue_id))

    def max_offset(self, broker: str, topic: str, queue_id: int) -> int:
        """The offset after the last message of a queue (the next offset to be written)."""
        fields = {"topic": topic, "queueId": str(queue_id)}
        resp = self.call(broker, GET_MAX_OFFSET, fields).check(f"GET_MAX_OFFSET {topic}/{queue_id}")
        return int(resp.fields["offset"])

    def min_offset(self, broker: str, topic: str, queue_id: int) -> int:
        """The offset of the oldest message a queue still holds."""
        fields = {"topic": topic, "queueId": str(queue_id)}
        resp = self.call(broker, GET_MIN_OFFSET, fields).check(f"GET_MIN_OFFSET {topic}/{queue_id}")
        return int(resp.fields["offset"])

    def query_consumer_offset(self, broker: str, group: str, topic: str, queue_id: int) -> int | None:
        """A consumer group's committed offset of a queue (the next offset to consume), None if it has none."""
        fields = {"consumerGroup": group, "topic": topic, "queueId": str(queue_id), "setZeroIfNotFound": "false"}
        resp = self.call(broker, QUERY_CONSUMER_OFFSET, fields)
        if resp.code == QUERY_NOT_FOUND:
            return None
        return int(resp.check(f"QUERY_CONSUMER_OFFSET {group} {topic}/{queue_id}").fields["offset"])

    def update_consumer_offset(self, broker: str, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Set a consumer group's committed offset of a queue (what ``commitOffset`` of a 4.x consumer sends)."""
        fields = {"consumerGroup": group, "topic": topic, "queueId": str(queue_id), "commitOffset": str(offset)}
        self.call(broker, UPDATE_CONSUMER_OFFSET, fields).check(f"UPDATE_CONSUMER_OFFSET {group} {topic}/{queue_id}")

    def register_consumer_group(self, broker: str, client_id: str, group: str) -> None:
        """Send the heartbeat a 4.x pull consumer of ``group`` sends; a broker that auto-creates groups creates it."""
        consumer = {
            "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "subscriptionDataSet": [], "unitMode": False,
        }
        body = json.dumps({"clientID": client_id, "producerDataSet": [], "consumerDataSet": [consumer]}).encode()
        self.call(broker, HEART_BEAT, body=body).check(f"HEART_BEAT {group}")

    def store_time(self, broker: str, group: str, topic: str, queue_id: int, offset: int) -> tuple[int, int] | None:
        """(queue offset, store timestamp in ms) of the first message of a queue at or after ``offset``: one
        PULL_MESSAGE of one message, not suspended, its subscription in the request (``*``), no offset committed.
        None when the queue holds no message there (or not yet: an offset at or past its max offset)."""
        fields = {
            "consumerGroup": group, "topic": topic, "queueId": str(queue_id), "queueOffset": str(offset),
            "maxMsgNums": "1", "sysFlag": str(_FLAG_SUBSCRIPTION), "commitOffset": "0",
            "suspendTimeoutMillis": "0", "subscription": "*", "subVersion": "0", "expressionType": "TAG",
        }
        resp = self.call(broker, PULL_MESSAGE, fields)
        if resp.code in (PULL_NOT_FOUND, PULL_OFFSET_MOVED, PULL_RETRY_IMMEDIATELY):
            return None
        body = resp.check(f"PULL_MESSAGE {group} {topic}/{queue_id}@{offset}").body
        return _stored_at(body) if body else None


def _stored_at(body: bytes) -> tuple[int, int]:
    """(queue offset, store timestamp) of the first message in a pull response's body (the store's layout,
    MessageDecoder: size, magic, body CRC, queue id, flag, queue offset, physical offset, sys flag, born time, born
    host, store time, ...)."""
    if len(body) < 76:
        raise RemotingError(-1, f"a pulled message of {len(body)} bytes is too short", "PULL_MESSAGE")
    (queue_offset,) = struct.unpack_from(">q", body, 20)
    (sys_flag,) = struct.unpack_from(">i", body, 36)
    (stored,) = struct.unpack_from(">q", body, 48 + (20 if sys_flag & _BORNHOST_V6 else 8))
    return queue_offset, stored


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)
