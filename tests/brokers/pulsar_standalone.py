"""Real Apache Pulsar standalone (broker + one in-process bookie, RocksDB metadata) from Maven Central jars.

``org.apache.pulsar.PulsarStandaloneStarter`` runs from the cached classpath (scripts/fetch-jars.sh
pulsar: ``pulsar-broker`` 4.0.x and its dependencies, ~235 MB, ~3 min cold) without functions worker
or stream storage, bound to 127.0.0.1 on free ports. Ledgers are made small
(``managedLedgerMaxEntriesPerLedger``, no minimum rollover time) so that tests see ledger
rollovers: message ids that jump from one ledger id to a later one. Retention keeps rolled
ledgers for an hour even without a subscription.

Measured here (2 cores, shared): the broker port accepts after ~13 s, the ``public/default``
namespace exists ~4 s later; RSS ~300 MB with the heap flags below.

Readiness: the admin REST API lists the ``public/default`` namespace.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from tests.brokers._process import (
    LOOPBACK,
    ChildProcess,
    MissingDependencyError,
    OneProcessBroker,
    free_ports,
    jars_dir,
    port_accepting,
)

PULSAR_VERSION = "4.0.7"  # keep in step with tests/brokers/jars/pulsar/pom.xml

_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.out.ref = STDOUT
logger.standalone.name = org.apache.pulsar.PulsarStandalone
logger.standalone.level = info
"""


class PulsarStandalone(OneProcessBroker):
    """One Pulsar standalone: ``start``, ``stop`` (SIGTERM), ``kill`` (SIGKILL), ``restart``; data in ``workdir``."""

    stop_timeout = 30.0

    def __init__(self, workdir: Path, *, entries_per_ledger: int = 50, heap: str = "384m",
                 config: Mapping[str, object] | None = None, startup_timeout: float = 120.0,
                 java: str = "java") -> None:
        self.workdir = Path(workdir)
        self.entries_per_ledger = entries_per_ledger
        self.heap = heap
        self.java = java
        self.startup_timeout = startup_timeout
        self.port, self.web_port, self.bookie_port = free_ports(3)
        self._extra = dict(config or {})
        self._proc = ChildProcess("pulsar-standalone", [], self.workdir / "pulsar.log", cwd=self.workdir)
        self.startup_seconds: float | None = None

    @property
    def service_url(self) -> str:
        return f"pulsar://{LOOPBACK}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.web_port}/admin/v2"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "standalone.conf"
        conf.write_text("".join(f"{k}={v}\n" for k, v in self._config().items()))
        (self.workdir / "log4j2.properties").write_text(_LOG4J2)
        if shutil.which(self.java) is None:
            raise MissingDependencyError(f"'{self.java}' is not on PATH: Pulsar {PULSAR_VERSION} needs Java 17+")
        self._proc.argv = [
            self.java, "-Xms64m", f"-Xmx{self.heap}", "-XX:MaxDirectMemorySize=256m", "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}",
            "-cp", str(jars_dir("pulsar", PULSAR_VERSION) / "*"),
            "org.apache.pulsar.PulsarStandaloneStarter", "-c", str(conf), "-nfw", "-nss",
            "--metadata-dir", str(self.workdir / "data" / "metadata"),
            "--bookkeeper-dir", str(self.workdir / "data" / "bookkeeper"),
            "--bookkeeper-port", str(self.bookie_port),
        ]
        self._launch(f"Pulsar standalone on {self.service_url}", self._ready, 0.2)

    def admin(self, method: str, path: str, body: object | None = None) -> object:
        """One admin REST call (``path`` under /admin/v2); returns the decoded JSON answer (None if empty)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.admin_url}/{path.lstrip('/')}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read()
        return json.loads(text) if text else None

    def create_partitioned_topic(self, topic: str, partitions: int) -> None:
        self.admin("PUT", f"persistent/public/default/{topic}/partitions", partitions)

    def _config(self) -> dict[str, object]:
        return {
            "clusterName": "standalone",
            "bindAddress": LOOPBACK,
            "advertisedAddress": LOOPBACK,
            "brokerServicePort": self.port,
            "webServicePort": self.web_port,
            "functionsWorkerEnabled": "false",
            "managedLedgerDefaultEnsembleSize": 1,
            "managedLedgerDefaultWriteQuorum": 1,
            "managedLedgerDefaultAckQuorum": 1,
            "managedLedgerMaxEntriesPerLedger": self.entries_per_ledger,
            "managedLedgerMinLedgerRolloverTimeMinutes": 0,
            "managedLedgerCacheSizeMB": 16,
            "defaultRetentionTimeInMinutes": 60,
            "defaultRetentionSizeInMB": 512,
            "numIOThreads": 2,
            "numHttpServerThreads": 4,
            "numOrderedExecutorThreads": 2,
            "numExecutorThreadPoolSize": 2,
            "bookkeeperNumberOfChannelsPerBookie": 2,
            "allowAutoTopicCreation": "true",
            "allowAutoTopicCreationType": "non-partitioned",
            "brokerDeleteInactiveTopicsEnabled": "false",
            "transactionCoordinatorEnabled": "false",
            "webSocketServiceEnabled": "false",
            "loadBalancerEnabled": "false",
            **self._extra,
        }

    def _ready(self) -> bool:
        if not port_accepting(self.port) or not port_accepting(self.web_port):
            return False
        try:
            namespaces = self.admin("GET", "namespaces/public")
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return isinstance(namespaces, list) and "public/default" in namespaces
