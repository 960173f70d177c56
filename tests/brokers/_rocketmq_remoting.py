"""A minimal RocketMQ remoting-protocol (TCP + JSON header) client for the fixture's admin calls.

Only what the fixture needs: cluster info from the name server (readiness), create a topic on a
broker, and a topic's route from the name server. It speaks the same frames as ``mqadmin``
(``org.apache.rocketmq.tools.command.MQAdminStartup``) without starting a JVM per call.

Frame: ``int32 length | int32 (serialize type << 24 | header length) | JSON header | body``.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import struct
from typing import Any

# org.apache.rocketmq.remoting.protocol.RequestCode / ResponseCode
UPDATE_AND_CREATE_TOPIC = 17
UPDATE_BROKER_CONFIG = 25
GET_ROUTEINFO_BY_TOPIC = 105
GET_BROKER_CLUSTER_INFO = 106
SUCCESS = 0
TOPIC_NOT_EXIST = 17

_RESPONSE_FLAG = 1
_opaque = itertools.count(1)


class RemotingError(RuntimeError):
    """A remoting call failed: the code and remark the server sent."""

    def __init__(self, code: int, remark: str | None, request: str) -> None:
        super().__init__(f"{request} failed: response code {code}: {remark}")
        self.code = code
        self.remark = remark


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _fastjson_loads(body: bytes) -> Any:
    """RocketMQ's fastjson writes maps with integer keys unquoted ({0:"addr"}): quote them, then parse."""
    text = body.decode("utf-8")
    return json.loads(re.sub(r'([{,])\s*(-?\d+)\s*:', r'\1"\2":', text))


def call(address: str, code: int, ext_fields: dict[str, str] | None = None, body: bytes = b"",
         timeout: float = 5.0) -> tuple[int, str | None, bytes]:
    """One request/response; returns (response code, remark, body)."""
    opaque = next(_opaque)
    header = json.dumps({
        "code": code, "language": "PYTHON", "version": 500, "opaque": opaque, "flag": 0,
        "extFields": ext_fields or {}, "serializeTypeCurrentRPC": "JSON",
    }).encode()
    frame = struct.pack(">II", 4 + len(header) + len(body), len(header)) + header + body
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(frame)
        (length,) = struct.unpack(">I", _recv_exact(sock, 4))
        payload = _recv_exact(sock, length)
    (ori_header_len,) = struct.unpack(">I", payload[:4])
    header_len = ori_header_len & 0xFFFFFF
    resp = json.loads(payload[4:4 + header_len])
    if not resp.get("flag", 0) & _RESPONSE_FLAG or resp.get("opaque") != opaque:
        raise ConnectionError(f"unexpected frame from {address}: {resp}")
    return int(resp["code"]), resp.get("remark"), payload[4 + header_len:]


def cluster_info(namesrv: str) -> dict[str, Any]:
    """The name server's ClusterInfo: ``brokerAddrTable`` and ``clusterAddrTable``."""
    code, remark, body = call(namesrv, GET_BROKER_CLUSTER_INFO)
    if code != SUCCESS:
        raise RemotingError(code, remark, "GET_BROKER_CLUSTER_INFO")
    return dict(_fastjson_loads(body))


def topic_route(namesrv: str, topic: str) -> dict[str, Any] | None:
    """The topic's route (``queueDatas``, ``brokerDatas``) from the name server, or None if it has none."""
    code, remark, body = call(namesrv, GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    if code == TOPIC_NOT_EXIST:
        return None
    if code != SUCCESS:
        raise RemotingError(code, remark, f"GET_ROUTEINFO_BY_TOPIC {topic}")
    return dict(_fastjson_loads(body))


def create_topic(broker: str, topic: str, queues: int, *, message_type: str = "NORMAL", perm: int = 6) -> None:
    """``mqadmin updateTopic``: create or update ``topic`` on one broker with ``queues`` read/write queues."""
    fields = {
        "topic": topic, "defaultTopic": "TBW102", "readQueueNums": str(queues), "writeQueueNums": str(queues),
        "perm": str(perm), "topicFilterType": "SINGLE_TAG", "topicSysFlag": "0", "order": "false",
        "attributes": f"+message.type={message_type}",
    }
    code, remark, _ = call(broker, UPDATE_AND_CREATE_TOPIC, fields)
    if code != SUCCESS:
        raise RemotingError(code, remark, f"UPDATE_AND_CREATE_TOPIC {topic}")


def update_broker_config(broker: str, properties: dict[str, str]) -> None:
    """``mqadmin updateBrokerConfig``: set broker properties at run time (the broker persists them)."""
    body = "".join(f"{k}={v}\n" for k, v in properties.items()).encode()
    code, remark, _ = call(broker, UPDATE_BROKER_CONFIG, body=body)
    if code != SUCCESS:
        raise RemotingError(code, remark, f"UPDATE_BROKER_CONFIG {sorted(properties)}")
