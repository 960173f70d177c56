"""Apache RocketMQ 5.x from Maven Central jars: a name server and a broker.

Two JVMs, both from the cached classpath (scripts/fetch-jars.sh), speaking the remoting protocol
that 4.x clients (the ``rocketmq`` 0.4.4 package, which streamrover uses) talk:

- ``org.apache.rocketmq.namesrv.NamesrvStartup``;
- ``org.apache.rocketmq.broker.BrokerStartup`` on ``broker_address``.

No proxy: the 5.x gRPC protocol (``rocketmq-python-client``) cannot read by offset (the 5.5 proxy
answers UNIMPLEMENTED to PullMessage/QueryOffset/GetOffset), so nothing here uses it.

All listeners bind 127.0.0.1. The broker's HA port has no bind setting in 5.5 and would take the
wildcard address, and the name server dials the host's primary address to reach itself; the
LD_PRELOAD shim ``native/loopback_only.c`` rewrites those to loopback.

Topics: ``create_topic(name, queues)`` sends ``UPDATE_AND_CREATE_TOPIC`` to the broker (what ``mqadmin
updateTopic`` does) and waits until the name server routes it. ``autoCreateTopicEnable`` is on as well
(``default_queues`` queues), but create topics first to get a known queue count.

Readiness: name server: its port accepts and answers GET_BROKER_CLUSTER_INFO. Broker: it logged
"boot success", the name server lists it at its address, and its port accepts.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from tests.brokers import _rocketmq_remoting as remoting
from tests.brokers._native import loopback_only_library
from tests.brokers._process import (
    LOOPBACK,
    BrokerError,
    BrokerStartError,
    ChildProcess,
    Lifecycle,
    MissingDependencyError,
    free_port,
    jars_dir,
    port_accepting,
    rss_bytes,
    wait_until,
)

ROCKETMQ_VERSION = "5.5.0"  # keep in step with tests/brokers/jars/rocketmq/pom.xml

_LOGBACK = """\
<configuration>
  <appender name="STDOUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d{HH:mm:ss.SSS} %p %t %logger{0} - %m%n</pattern></encoder>
  </appender>
  <logger name="RocketmqProxyWatermark" level="WARN"/>
  <logger name="RocketmqBrokerWatermark" level="WARN"/>
  <logger name="RocketmqStoreStats" level="WARN"/>
  <logger name="RocketmqWaterMark" level="WARN"/>
  <logger name="RocketmqTraffic" level="WARN"/>
  <root level="INFO"><appender-ref ref="STDOUT"/></root>
</configuration>
"""


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def _broker_port() -> int:
    """A free port p with p-2 (the broker's "fast" remoting port) and p+1 (its HA port) free too."""
    for _ in range(200):
        p = free_port()
        if p > 1026 and _bindable(p - 2) and _bindable(p + 1):
            return p
    raise BrokerError("found no free port p on 127.0.0.1 with p-2 and p+1 free as well")


class RocketMQBroker(Lifecycle):
    """RocketMQ 5.x: name server + broker, on 127.0.0.1 free ports kept across restarts.

    ``workdir`` holds ``store/`` (commit log, consume queues: durable across ``stop``/``kill``/``restart``),
    the generated configs, ``home/`` (ROCKETMQ_HOME and user.home of the JVMs) and the two logs
    ``namesrv.log`` and ``broker.log`` (stdout of every run, appended).
    """

    cluster = "DefaultCluster"
    broker_name = "broker-a"

    def __init__(self, workdir: Path, *, namesrv_heap: str = "128m", broker_heap: str = "384m",
                 default_queues: int = 4, startup_timeout: float = 120.0, java: str = "java") -> None:
        self.workdir = Path(workdir)
        self.namesrv_heap = namesrv_heap
        self.broker_heap = broker_heap
        self.default_queues = default_queues
        self.startup_timeout = startup_timeout
        self.java = java
        self.namesrv_port = free_port()
        self.broker_port = _broker_port()
        self._namesrv = ChildProcess("rocketmq-namesrv", [], self.workdir / "namesrv.log", cwd=self.workdir)
        self._broker = ChildProcess("rocketmq-broker", [], self.workdir / "broker.log", cwd=self.workdir)
        self.startup_seconds: float | None = None

    # ----------------------------------------------------------------- addresses
    @property
    def namesrv_address(self) -> str:
        """Name server ``host:port`` (4.x remoting clients: ``set_namesrv_addr``)."""
        return f"{LOOPBACK}:{self.namesrv_port}"

    @property
    def broker_address(self) -> str:
        """The broker's remoting ``host:port`` (as registered in the name server)."""
        return f"{LOOPBACK}:{self.broker_port}"

    @property
    def store_dir(self) -> Path:
        return self.workdir / "store"

    @property
    def log_paths(self) -> tuple[Path, Path]:
        return self._namesrv.log_path, self._broker.log_path

    @property
    def pids(self) -> tuple[int | None, int | None]:
        return self._namesrv.pid, self._broker.pid

    def rss_bytes(self) -> int:
        return rss_bytes(list(self.pids))

    def is_running(self) -> bool:
        return self._namesrv.running() and self._broker.running()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the name server, then the broker, and wait until the broker is registered."""
        t0 = time.monotonic()
        self._write_configs()
        if not self._namesrv.running():
            self._namesrv.argv = self._java("namesrv", self.namesrv_heap, "org.apache.rocketmq.namesrv.NamesrvStartup",
                                            "-c", str(self.workdir / "namesrv.properties"))
            self._namesrv.env = self._env()
            self._namesrv.start()
            self._wait(f"the RocketMQ name server on {self.namesrv_address}", self._namesrv_ready, [self._namesrv])
        self._broker.argv = self._java("broker", self.broker_heap, "org.apache.rocketmq.broker.BrokerStartup",
                                       "-c", str(self.workdir / "broker.conf"))
        self._broker.env = self._env()
        self._broker.start()
        self._wait(f"the RocketMQ broker on {self.broker_address}",
                   self._broker_ready, [self._namesrv, self._broker])
        self.startup_seconds = time.monotonic() - t0

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the broker, then the name server (SIGKILL after ``timeout`` s each)."""
        self._broker.stop(timeout)
        self._namesrv.stop(timeout)

    def kill(self) -> None:
        """SIGKILL both JVMs."""
        self._broker.kill()
        self._namesrv.kill()

    def kill_broker(self) -> None:
        """SIGKILL only the broker JVM (the name server keeps running)."""
        self._broker.kill()

    # ----------------------------------------------------------------- admin
    def create_topic(self, topic: str, queues: int, *, timeout: float = 30.0) -> None:
        """Create ``topic`` with ``queues`` read/write queues and wait until the name server routes it."""
        remoting.create_topic(self.broker_address, topic, queues)

        def routed() -> bool:
            route = remoting.topic_route(self.namesrv_address, topic)
            return route is not None and any(q.get("writeQueueNums") == queues for q in route.get("queueDatas", []))

        wait_until(f"the name server to route topic {topic!r} with {queues} queues", routed, timeout=timeout,
                   procs=[self._namesrv, self._broker], interval=0.05)

    def topic_route(self, topic: str) -> dict[str, object] | None:
        return remoting.topic_route(self.namesrv_address, topic)

    # ----------------------------------------------------------------- internals
    def _home(self) -> Path:
        return self.workdir / "home"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["ROCKETMQ_HOME"] = str(self._home())
        preload = str(loopback_only_library())
        env["LD_PRELOAD"] = f"{preload} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else preload
        return env

    def _java(self, role: str, heap: str, main: str, *args: str) -> list[str]:
        if shutil.which(self.java) is None:
            raise MissingDependencyError(f"'{self.java}' is not on PATH: RocketMQ {ROCKETMQ_VERSION} needs Java 8+")
        classpath = str(jars_dir("rocketmq", ROCKETMQ_VERSION) / "*")
        return [self.java, f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseG1GC", "-XX:MaxDirectMemorySize=256m",
                "-Djava.awt.headless=true", f"-Duser.home={self._home()}", f"-Djava.io.tmpdir={self._home()}",
                # No TLS on the remoting ports (the default "permissive" builds a self-signed SslContext: ~4 s).
                "-Dtls.server.mode=disabled", "-Djava.security.egd=file:/dev/./urandom",
                f"-Drocketmq.home.dir={self._home()}",
                f"-Drmq.logback.configurationFile={self.workdir / 'logback.xml'}",
                f"-Dstreamrover.fixture.role={role}", "-cp", classpath, main, *args]

    def _write_configs(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._home().mkdir(exist_ok=True)
        (self.workdir / "logback.xml").write_text(_LOGBACK)
        (self.workdir / "namesrv.properties").write_text(
            f"listenPort={self.namesrv_port}\nbindAddress={LOOPBACK}\n")
        broker = {
            "brokerClusterName": self.cluster,
            "brokerName": self.broker_name,
            "brokerId": "0",
            "brokerRole": "ASYNC_MASTER",
            "namesrvAddr": self.namesrv_address,
            "listenPort": str(self.broker_port),
            "haListenPort": str(self.broker_port + 1),
            "bindAddress": LOOPBACK,
            "brokerIP1": LOOPBACK,
            "brokerIP2": LOOPBACK,
            "storePathRootDir": str(self.store_dir),
            "storePathCommitLog": str(self.store_dir / "commitlog"),
            "flushDiskType": "ASYNC_FLUSH",
            "autoCreateTopicEnable": "true",
            "autoCreateSubscriptionGroup": "true",
            "defaultTopicQueueNums": str(self.default_queues),
            # Small (sparse) commit-log files; the 1 GiB default is pointless for tests.
            "mappedFileSizeCommitLog": str(64 * 1024 * 1024),
            # The default 75 % refuses writes on a fuller disk of a dev machine.
            "diskMaxUsedSpaceRatio": "95",
        }
        (self.workdir / "broker.conf").write_text("".join(f"{k}={v}\n" for k, v in broker.items()))

    def _wait(self, what: str, condition: Callable[[], bool], procs: list[ChildProcess]) -> None:
        try:
            wait_until(what, condition, timeout=self.startup_timeout, procs=procs, interval=0.25)
        except BrokerStartError:
            self.kill()
            raise

    def _namesrv_ready(self) -> bool:
        if not port_accepting(self.namesrv_port):
            return False
        remoting.cluster_info(self.namesrv_address)
        return True

    def _broker_ready(self) -> bool:
        if not self._broker.log_contains("boot success"):
            return False
        info = remoting.cluster_info(self.namesrv_address)
        addrs = info.get("brokerAddrTable", {}).get(self.broker_name, {}).get("brokerAddrs", {})
        if addrs.get("0") != self.broker_address:
            # The broker's registration at start races its name-server client's first scan and is lost;
            # the next periodic one comes 10 s later. Re-setting brokerPermission (to its default, read-write)
            # makes the broker register at once.
            remoting.update_broker_config(self.broker_address, {"brokerPermission": "6"})
            return False
        return port_accepting(self.broker_port)
