"""pulsar-client glue for the Pulsar source: URIs, partition names, client option values, the client's logger, raw
batches, the publish time of a shard's first message."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pulsar
import pyarrow as pa

from streamrover.sources.api import ReadBatch, SourceError, SourceUnavailableError

log = logging.getLogger("streamrover.sources.pulsar")
RAW_SCHEMA = pa.schema(
    {
        "key": pa.binary(),
        "value": pa.binary(),
        "timestamp": pa.int64(),  # the publish time
        "position": pa.int64(),
        "batch_index": pa.int32(),
    }
)


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


def first_time(
    open_reader: Callable[[], Any], full: str, position: Callable[[Any], int], start: int, end: int, wait: float
) -> float | None:
    """The publish time (ms) of the first message of partition ``full`` in ``[start, end)`` (None: the range holds
    none), from readers ``open_reader()`` opens at ``start``: messages of other partitions (a routed reader of the
    partitioned topic), before ``start`` or duplicated are passed over. The range's messages exist (its end was
    polled), so a reader that delivers nothing of it for ``wait`` seconds stalled (pulsar-lite's readers do): a new
    one is opened, twice; then :class:`SourceUnavailableError`.
    """
    for _ in range(3):
        reader = open_reader()
        try:
            deadline = time.monotonic() + wait
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = reader.read_next(max(1, int(left * 1000)))
                except pulsar.Timeout:
                    break
                except pulsar.PulsarException as exc:
                    raise SourceUnavailableError(f"reading the first message of {full} at {start}: {exc!r}") from exc
                pos = position(msg) if msg.topic_name() == full else -1
                if pos >= start:
                    return float(msg.publish_timestamp()) if pos < end else None
        finally:
            reader.close()
    raise SourceUnavailableError(f"no message of {full} at or after {start} in 3 x {wait:.0f}s")


def raw_batch(msgs: list[tuple[Any, int, int]], start: int, end: int) -> ReadBatch:
    """A ``raw`` read batch of ``(message, position, batch index)`` covering ``[start, end)``."""
    positions = pa.array([p for _, p, _ in msgs], pa.int64())
    cols = [
        pa.array([(m.partition_key() or "").encode() for m, _, _ in msgs], pa.binary()),
        pa.array([m.data() for m, _, _ in msgs], pa.binary()),
        pa.array([m.publish_timestamp() for m, _, _ in msgs], pa.int64()),
        positions,
        pa.array([b for _, _, b in msgs], pa.int32()),
    ]
    return ReadBatch(pa.RecordBatch.from_arrays(cols, schema=RAW_SCHEMA), start, end, positions)
