"""The fixture's RocketMQ admin calls, over the remoting client streamrover ships.

Cluster info from the name server (readiness), create a topic on a broker, a topic's raw route
from the name server, and broker config updates: the same frames ``mqadmin``
(``org.apache.rocketmq.tools.command.MQAdminStartup``) sends, without starting a JVM per call.
The protocol itself (framing, routes, offsets) is :mod:`streamrover.sources.rocketmq_remoting`.
"""

from __future__ import annotations

from typing import Any

from streamrover.sources.rocketmq_remoting import (
    GET_ROUTEINFO_BY_TOPIC,
    TOPIC_NOT_EXIST,
    RemotingClient,
    RemotingError,
    Response,
    fastjson_loads,
)

# org.apache.rocketmq.remoting.protocol.RequestCode (admin requests the source does not need)
UPDATE_AND_CREATE_TOPIC = 17
UPDATE_BROKER_CONFIG = 25
GET_BROKER_CLUSTER_INFO = 106

__all__ = ["RemotingError", "cluster_info", "create_topic", "topic_route", "update_broker_config"]


def _call(address: str, code: int, fields: dict[str, str] | None = None, body: bytes = b"") -> Response:
    """One request on a fresh connection (admin calls are rare; a fixture keeps no sockets open)."""
    client = RemotingClient()
    try:
        return client.call(address, code, fields, body)
    finally:
        client.close()


def cluster_info(namesrv: str) -> dict[str, Any]:
    """The name server's ClusterInfo: ``brokerAddrTable`` and ``clusterAddrTable``."""
    resp = _call(namesrv, GET_BROKER_CLUSTER_INFO).check("GET_BROKER_CLUSTER_INFO")
    return dict(fastjson_loads(resp.body))


def topic_route(namesrv: str, topic: str) -> dict[str, Any] | None:
    """The topic's route (``queueDatas``, ``brokerDatas``) from the name server, or None if it has none."""
    resp = _call(namesrv, GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    if resp.code == TOPIC_NOT_EXIST:
        return None
    return dict(fastjson_loads(resp.check(f"GET_ROUTEINFO_BY_TOPIC {topic}").body))


def create_topic(broker: str, topic: str, queues: int, *, message_type: str = "NORMAL", perm: int = 6) -> None:
    """``mqadmin updateTopic``: create or update ``topic`` on one broker with ``queues`` read/write queues."""
    fields = {
        "topic": topic, "defaultTopic": "TBW102", "readQueueNums": str(queues), "writeQueueNums": str(queues),
        "perm": str(perm), "topicFilterType": "SINGLE_TAG", "topicSysFlag": "0", "order": "false",
        "attributes": f"+message.type={message_type}",
    }
    _call(broker, UPDATE_AND_CREATE_TOPIC, fields).check(f"UPDATE_AND_CREATE_TOPIC {topic}")


def update_broker_config(broker: str, properties: dict[str, str]) -> None:
    """``mqadmin updateBrokerConfig``: set broker properties at run time (the broker persists them)."""
    body = "".join(f"{k}={v}\n" for k, v in properties.items()).encode()
    _call(broker, UPDATE_BROKER_CONFIG, body=body).check(f"UPDATE_BROKER_CONFIG {sorted(properties)}")
