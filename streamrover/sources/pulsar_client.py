"""pulsar-client glue for the Pulsar source: URIs, partition names, client option values, the client's logger."""

from __future__ import annotations

import logging
from typing import Any

import pulsar

from streamrover.sources.api import SourceError

log = logging.getLogger("streamrover.sources.pulsar")


def parse_uri(uri: str) -> tuple[str, str]:
    """``pulsar://HOST:PORT/[TENANT/NS/]TOPIC`` -> (service url, full topic name)."""
    scheme, sep, rest = uri.partition("://")
    hosts, _, path = rest.partition("/")
    parts = path.split("/") if path else []
    if scheme not in ("pulsar", "pulsar+ssl") or not sep or not hosts or len(parts) not in (1, 3) or not all(parts):
        raise SourceError(f"a Pulsar URI looks like pulsar://HOST:PORT/[TENANT/NAMESPACE/]TOPIC, got {uri!r}")
    tenant, ns, topic = parts if len(parts) == 3 else ("public", "default", parts[0])
    return f"{scheme}://{hosts}", f"persistent://{tenant}/{ns}/{topic}"


def client_value(text: str) -> Any:
    """A ``pulsar.Client`` keyword argument's value from its option text: true/false and numbers converted."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def client_logger() -> Any:
    """The client library's own console logger at this module's logging level (Warn unless configured).

    Not the ``logging`` logger itself: given one, pulsar-client 3.x formats a DEBUG line per
    received message whatever the level (and prints a message whose value is not UTF-8,
    payload included, to stdout).
    """
    level = log.getEffectiveLevel()  # the Pulsar source's logger
    if level <= logging.DEBUG:
        return pulsar.ConsoleLogger(pulsar.LoggerLevel.Debug)
    if level <= logging.INFO:
        return pulsar.ConsoleLogger(pulsar.LoggerLevel.Info)
    if level <= logging.WARNING:
        return pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)
    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


def partition_index(name: str) -> int:
    """The partition number in ``...-partition-N`` (-1 for a non-partitioned topic)."""
    _, sep, num = name.rpartition("-partition-")
    return int(num) if sep and num.isdigit() else -1
