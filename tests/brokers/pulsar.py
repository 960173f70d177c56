"""pulsar-lite: an embedded Pulsar-protocol broker (Rust, RocksDB), the binary in the ``pulsar-lite`` wheel.

Runs ``pulsar-lite --config <toml> --addr 127.0.0.1:<port> --db-path <dir>`` with the metrics HTTP
server off (by default it binds 0.0.0.0:8080). The RocksDB directory survives ``stop``/``kill``, so
``restart`` keeps topics and (non-batched) messages. Quirks (ENVIRONMENT.md, plus measured here):

- Every topic is partitioned with ``default_partitions`` partitions (0 = not partitioned); there is
  no admin API to create a topic with another count.
- A name of one partition (``<topic>-partition-<n>``) is itself answered as a partitioned topic with
  ``default_partitions`` partitions (real Pulsar answers 0), so the C++-based pulsar-client cannot
  open a reader/consumer on a single partition: it subscribes to ``<topic>-partition-0-partition-k``.
  Read the whole partitioned topic and route by ``message.topic_name()``.
- A partitioned-metadata lookup (``client.get_topic_partitions``) creates the topic.
- ``Reader.has_message_available()`` on an empty partition gets "Topic has no messages"
  (UnknownError) from the broker, and pulsar-client 3.13 then aborts the whole Python process
  (``std::future_error: Promise already satisfied``). Use ``read_next(timeout)`` instead.
- Backlog reads on Exclusive/Failover subscriptions and readers can deliver duplicates:
  deduplicate by message id. ``seek`` on a live consumer does nothing. Batched acks are not persisted.

Readiness: the port accepts and a Pulsar binary-protocol CONNECT is answered with CONNECTED.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping
from pathlib import Path

from tests.brokers._process import (
    LOOPBACK,
    ChildProcess,
    MissingDependencyError,
    OneProcessBroker,
    free_port,
    port_accepting,
)

_CMD_CONNECT = 2
_CMD_CONNECTED = 3


def pulsar_lite_binary() -> Path:
    """Path of the ``pulsar-lite`` binary inside the installed pulsar-lite wheel."""
    try:
        import pulsar_lite
    except ImportError as exc:
        raise MissingDependencyError("the Pulsar broker comes from the PyPI package pulsar-lite: "
                                     "pip install pulsar-lite") from exc
    path = Path(pulsar_lite.__file__).parent / "bin" / "pulsar-lite"
    if not path.exists():
        raise MissingDependencyError(f"pulsar-lite is installed but has no binary at {path}")
    return path


def _toml(config: Mapping[str, object]) -> str:
    """TOML for a flat mapping whose values are str/int/bool or one level of tables."""
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    plain = [f"{k} = {value(v)}" for k, v in config.items() if not isinstance(v, Mapping)]
    tables = []
    for k, v in config.items():
        if isinstance(v, Mapping):
            tables.append(f"\n[{k}]\n" + "\n".join(f"{kk} = {value(vv)}" for kk, vv in v.items()))
    return "\n".join(plain) + "\n" + "\n".join(tables) + "\n"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def pulsar_handshake(host: str, port: int, timeout: float = 2.0) -> bool:
    """Send a Pulsar CONNECT frame and return True if the broker answers CONNECTED."""
    client_version = b"streamrover-fixture-probe"
    connect = b"\x0a" + _varint(len(client_version)) + client_version + b"\x20" + _varint(15)  # protocol v15
    command = b"\x08" + _varint(_CMD_CONNECT) + b"\x12" + _varint(len(connect)) + connect
    frame = struct.pack(">II", len(command) + 4, len(command)) + command
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(frame)
        header = s.recv(8)
        if len(header) < 8:
            return False
        (cmd_size,) = struct.unpack(">I", header[4:8])
        body = b""
        while len(body) < cmd_size:
            chunk = s.recv(cmd_size - len(body))
            if not chunk:
                return False
            body += chunk
    # BaseCommand field 1 (type) is a varint tagged 0x08 and comes first.
    return len(body) >= 2 and body[0] == 0x08 and body[1] == _CMD_CONNECTED


class PulsarLiteBroker(OneProcessBroker):
    """A pulsar-lite broker on 127.0.0.1:<free port> (kept across restarts) with RocksDB under ``workdir``."""

    stop_timeout = 10.0

    def __init__(self, workdir: Path, *, default_partitions: int = 4, log_level: str = "info",
                 config: Mapping[str, object] | None = None, startup_timeout: float = 30.0) -> None:
        self.workdir = Path(workdir)
        self.default_partitions = default_partitions
        self.log_level = log_level
        self._extra = dict(config or {})
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self._proc = ChildProcess("pulsar-lite", [], self.workdir / "pulsar-lite.log", cwd=self.workdir)
        self.startup_seconds: float | None = None

    @property
    def service_url(self) -> str:
        """``pulsar://127.0.0.1:<port>`` for ``pulsar.Client``."""
        return f"pulsar://{LOOPBACK}:{self.port}"

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def db_path(self) -> Path:
        return self.workdir / "db"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config: dict[str, object] = {
            "cluster": "standalone",
            "default_partitions": self.default_partitions,
            "log_level": self.log_level,
            **self._extra,
            "metrics": {"enabled": False},
        }
        conf = self.workdir / "pulsar-lite.toml"
        conf.write_text(_toml(config))
        self._proc.argv = [str(pulsar_lite_binary()), "--config", str(conf), "--addr", self.address,
                           "--db-path", str(self.db_path), "--log-level", self.log_level]
        self._launch(f"pulsar-lite on {self.address}", self._ready, 0.02)

    def _ready(self) -> bool:
        return port_accepting(self.port) and pulsar_handshake(LOOPBACK, self.port)
