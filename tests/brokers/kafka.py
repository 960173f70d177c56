"""A single-node Apache Kafka 4.x broker (KRaft, combined broker+controller) from Maven Central jars.

The storage directory is formatted once with a random cluster id; the broker then runs the
``kafka.Kafka`` main class from the cached classpath (scripts/fetch-jars.sh). Listeners bind
127.0.0.1 on free ports picked at construction and kept across restarts, so ``bootstrap`` stays
valid when a test kills (SIGKILL) and restarts the broker; the log dir is durable (flushed by
the OS page cache like any Kafka install), so acknowledged data with ``acks=all`` survives a kill.

Readiness: the port accepts and a metadata request through confluent-kafka lists this broker.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path

from tests.brokers._process import (
    LOOPBACK,
    BrokerError,
    ChildProcess,
    MissingDependencyError,
    OneProcessBroker,
    free_ports,
    jars_dir,
    port_accepting,
)

KAFKA_VERSION = "4.4.0"  # keep in step with tests/brokers/jars/kafka/pom.xml

_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = info
logger.request.name = kafka.request.logger
logger.request.level = warn
"""


def _random_cluster_id() -> str:
    """Kafka's cluster id format: a UUID as unpadded URL-safe base64 (what `kafka-storage random-uuid` prints).

    Like Kafka's ``Uuid.randomUuid`` it never starts with '-', which the storage tool would read as a flag.
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class KafkaBroker(OneProcessBroker):
    """One Kafka 4.x KRaft node: ``start``, ``stop`` (SIGTERM), ``kill`` (SIGKILL), ``restart``.

    ``workdir`` holds ``data/`` (the log dir, kept across restarts), ``server.properties``,
    ``log4j2.properties`` and ``kafka.log`` (stdout and stderr of every run, appended).
    ``properties`` are added to / override the generated server.properties.
    """

    stop_timeout = 30.0

    def __init__(self, workdir: Path, *, heap: str = "512m", startup_timeout: float = 90.0,
                 properties: Mapping[str, str] | None = None, java: str = "java") -> None:
        self.workdir = Path(workdir)
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.java = java
        self.port, self.controller_port = free_ports(2)
        self.cluster_id = _random_cluster_id()
        self._extra = dict(properties or {})
        self._proc = ChildProcess("kafka", [], self.workdir / "kafka.log", cwd=self.workdir)
        self._formatted = False
        self.startup_seconds: float | None = None

    # ----------------------------------------------------------------- addresses
    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for clients: ``127.0.0.1:<port>``."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def client_config(self, **overrides: object) -> dict[str, object]:
        """A librdkafka config dict pointing at this broker (plus ``overrides``)."""
        return {"bootstrap.servers": self.bootstrap, **overrides}

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the broker (formatting storage on first start) and wait until it serves metadata."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        if not self._formatted:
            self._format()
        self._proc.argv = self._argv()
        self._launch(f"Kafka on {self.bootstrap}", self._ready)

    # ----------------------------------------------------------------- internals
    def _classpath(self) -> str:
        return str(jars_dir("kafka", KAFKA_VERSION) / "*")

    def _java_base(self) -> list[str]:
        if shutil.which(self.java) is None:
            raise MissingDependencyError(f"'{self.java}' is not on PATH: Kafka {KAFKA_VERSION} needs Java 17+")
        return [self.java, f"-Xms{self.heap}", f"-Xmx{self.heap}", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}",
                "-cp", self._classpath()]

    def _argv(self) -> list[str]:
        return [*self._java_base(), "kafka.Kafka", str(self.workdir / "server.properties")]

    def _properties(self) -> dict[str, str]:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{LOOPBACK}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{LOOPBACK}:{self.port},CONTROLLER://{LOOPBACK}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            # After a SIGKILL the restarted node is refused (DUPLICATE_BROKER_REGISTRATION) until the dead
            # incarnation's session expires: 9 s by default, which made a kill+restart take ~12 s.
            "broker.session.timeout.ms": "2000",
            "broker.heartbeat.interval.ms": "500",
            # Compacted-topic tests: let the log cleaner look for dirty segments every 0.2 s (default 15 s).
            "log.cleaner.backoff.ms": "200",
        }
        props.update(self._extra)
        return props

    def _write_config(self) -> None:
        lines = [f"{k}={v}" for k, v in self._properties().items()]
        (self.workdir / "server.properties").write_text("\n".join(lines) + "\n")
        (self.workdir / "log4j2.properties").write_text(_LOG4J2)

    def _format(self) -> None:
        if (self.data_dir / "meta.properties").exists():
            self._formatted = True
            return
        argv = [*self._java_base(), "kafka.tools.StorageTool", "format", f"--cluster-id={self.cluster_id}",
                "-c", str(self.workdir / "server.properties")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise BrokerError(f"formatting Kafka storage in {self.data_dir} failed (exit {proc.returncode}):\n"
                              f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        self._formatted = True

    def _ready(self) -> bool:
        if not port_accepting(self.port):
            return False
        try:
            from confluent_kafka.admin import AdminClient
        except ImportError:  # no client here: the log line is the next best real condition
            return self._proc.log_contains("Kafka Server started")
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "socket.timeout.ms": 2000})
        md = admin.list_topics(timeout=2)
        if 1 not in md.brokers or not self._proc.log_contains("Kafka Server started"):
            return False
        # After a restart the node serves metadata before it leads its partitions again: ready means every
        # partition of every topic has its leader back (a read before that gets NOT_LEADER_FOR_PARTITION).
        return all(t.error is None and all(p.error is None and p.leader == 1 for p in t.partitions.values())
                   for t in md.topics.values())
