"""``streamrover run job.yaml`` as the tests drive it: a real controller process, its status document, Kafka."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from streamrover.operator.jobs import JobDir
from streamrover.shard_service import ShardClient
from streamrover.shard_service.client.tls import ClientTls
from streamrover.testing.procs import python_env
from tests.helpers import wait_until
from tests.trainers.cluster import records_table

HERE = Path(__file__).resolve().parent
HOG_SCRIPT = HERE / "hog_ledger_train.py"
PARTITIONS = 4


def kafka_topic(broker: Any, records: int) -> str:
    """A fresh topic holding the ledger records ``0 .. records-1`` as JSON, spread over four partitions."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"job-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        f.result(30)
    if records:
        produce(broker, topic, np.arange(records))
    return topic


def produce(broker: Any, topic: str, ids: np.ndarray) -> None:
    """Produce the ledger records of ``ids`` (JSON) to ``topic``, record ``i`` to partition ``i % 4``."""
    from confluent_kafka import Producer

    producer = Producer(broker.client_config(**{"acks": "all", "enable.idempotence": True, "linger.ms": 20}))
    send(producer, topic, ids)
    assert producer.flush(60) == 0


def send(producer: Any, topic: str, ids: np.ndarray) -> None:
    """Queue the ledger records of ``ids`` on a confluent-kafka ``producer`` (the caller flushes)."""
    table = records_table(ids)
    for i, x, y in zip(table["id"].tolist(), table["x"].tolist(), table["y"].tolist()):
        producer.produce(topic, value=json.dumps({"id": i, "x": x, "y": y}).encode(), partition=i % PARTITIONS)
        if i % 2000 == 0:
            producer.poll(0)


def ledger_spec(name: str, uri: str, records: int, out: Path, **trainer: Any) -> dict[str, Any]:
    """The torch ledger job (tests/trainers/ledger_train.py, with a memory hog on demand) as a job spec."""
    kafka = uri.startswith("kafka://")
    options = {"sr.format": "json", "sr.schema": "id:int64,x:float64,y:float64", "sr.max_delay_ms": 200}
    return {
        "name": name,
        "master": {"lease_ttl": 10},
        "datasets": [
            {"name": "stream", "uri": uri, "records_per_shard": 2000, **({"options": options} if kafka else {})}
        ],
        "trainer": {
            "script": str(HOG_SCRIPT),
            "args": ["--records", records, "--batch-size", 128, "--ckpt-every", 10, "--out", str(out)],
            "nproc_per_node": 2,
            "launcher_args": ["--monitor-interval", "0.2",
                              "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1,"
                                             "join_timeout=300"],
            **trainer,
        },
        "checkpoint": {"every_steps": 10},
    }


class RunningJob:
    """A job started by ``streamrover run`` in a subprocess, with its jobs home under the test's tmp dir."""

    def __init__(self, tmp_path: Path, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.tmp = tmp_path
        self.home = tmp_path / "home"
        self.spec_path = tmp_path / "job.yaml"
        self.spec_path.write_text(yaml.safe_dump(spec))
        self.name = spec["name"]
        self.spec = spec
        self.out = Path(spec["trainer"]["args"][spec["trainer"]["args"].index("--out") + 1])
        self.out.mkdir(parents=True, exist_ok=True)
        self.env = {**python_env(), "STREAMROVER_HOME": str(self.home), **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), self.env.get("PYTHONPATH", "")])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, platform: str = "local") -> None:
        cmd = [sys.executable, "-m", "streamrover.cli", "run", str(self.spec_path), "--platform", platform]
        with open(self.tmp / "run.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    @property
    def dir(self) -> JobDir:
        return JobDir(self.home / "jobs" / self.name)

    def status(self) -> dict[str, Any]:
        return self.dir.status()

    def node(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.status().get("nodes", []) if n["node_id"] == node_id), None)

    def running(self, node_id: str) -> bool:
        node = self.node(node_id)
        return bool(node and node["state"] == "running" and len(node.get("workers", {})) > 0)

    def acked(self) -> int:
        doc = self.status()
        if "master" not in doc or "state_dir" not in doc:
            return 0
        token = (Path(doc["state_dir"]) / "token").read_text().strip()
        tls = self.spec["master"].get("tls")  # the spec's files (local, Ray)
        client_tls = ClientTls(tls["ca"], tls.get("client_cert"), tls.get("client_key")) if tls else True
        with ShardClient(doc["master"], token=token, heartbeat=False, timeout=30, tls=client_tls) as admin:
            return admin.get_cursor()[1].size()

    def kill_agent(self, node_id: str) -> int:
        node = self.node(node_id)
        assert node is not None and node["pid"], self.status()
        os.kill(node["pid"], signal.SIGKILL)
        return int(node["pid"])

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def ledger(self) -> np.ndarray | None:
        path = self.out / "ledger.npy"
        return np.load(path) if path.exists() else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the controller stops its nodes and the master
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir.path.is_dir() and self.dir.request_stop():  # a detached controller
            wait_until(lambda: self.dir.controller_pid() is None, 90, "the detached controller to stop")

    def logs(self) -> str:
        files = sorted([self.tmp / "run.log", *(self.dir.path / "logs").glob("*.log")])
        parts = [f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in files if p.exists()]
        return "\n".join(parts) + "\n--- status\n" + json.dumps(self.status(), indent=1)[-4000:]
