"""``streamrover run --platform ray``: the torch ledger job on a two-node Ray cluster on this machine.

Ray nodes are real raylets (``ray.cluster_utils.Cluster``: a head with no CPUs for tasks,
two worker nodes with two CPUs each). Each trainer node is a Ray actor hosting a
``dlrover-run`` agent, one per bundle of the job's placement group (SPREAD). Mid-run the
Ray node hosting trainer node n1 is removed: its actor dies with it, the supervisor
relaunches the trainer node, and Ray places it on the other Ray node. The ledger is exact. The master
serves mutual TLS (``master.tls``): the controller and every agent and worker reach it only over TLS.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamrover.testing.certs import issue, make_ca
from tests.helpers import wait_until
from tests.operator.runner import RunningJob, kafka_topic, ledger_spec

pytestmark = pytest.mark.slow
RECORDS = 40_000


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # Ray binds every interface and advertises eth0 unless told this is no cluster of several hosts
    # (ENVIRONMENT.md); with this it binds and advertises 127.0.0.1. The controller inherits it.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    try:
        assert cluster.address.startswith("127.0.0.1:"), cluster.address
        yield cluster
    finally:
        cluster.shutdown()


def _ray_node(job: RunningJob, node_id: str) -> str:
    node = job.node(node_id)
    assert node is not None and node["detail"].startswith("ray node "), job.status()
    return str(node["detail"].split()[-1])


def test_a_removed_ray_node_s_trainer_node_is_relaunched_on_the_other(
    tmp_path: Path, kafka_broker: Any, ray_cluster: Any
) -> None:
    topic = kafka_topic(kafka_broker, RECORDS)
    spec = ledger_spec("on-ray", f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, tmp_path / "out",
                       nodes="2:2")  # fmt: skip
    pki = tmp_path / "pki"  # the master (an actor on the head node) serves mutual TLS; the actors' agents present
    ca = make_ca(pki)  # the job's client certificate (files every Ray node reads: here one machine)
    server, client = issue(ca, pki, "master"), issue(ca, pki, "client", server=False)
    spec["master"]["tls"] = {"cert": str(server.cert), "key": str(server.key), "ca": str(ca.cert),
                             "client_ca": str(ca.cert), "client_cert": str(client.cert),
                             "client_key": str(client.key)}  # fmt: skip
    job = RunningJob(tmp_path, spec, env={"RAY_ADDRESS": ray_cluster.address})
    job.start(platform="ray")
    try:
        wait_until(lambda: job.running("n0") and job.running("n1"), 240, "both trainer nodes training on Ray")
        hosts = {n: _ray_node(job, n) for n in ("n0", "n1")}
        assert hosts["n0"] != hosts["n1"], f"the placement group spreads the trainer nodes: {hosts}"
        wait_until(lambda: job.acked() >= 0.3 * RECORDS, 240, "30% of the records acked")
        (victim,) = [n for n in ray_cluster.worker_nodes if n.node_id == hosts["n1"]]
        ray_cluster.remove_node(victim, allow_graceful=False)
        started = time.monotonic()
        wait_until(lambda: job.node("n1.1") is not None, 240, "n1 relaunched on Ray")
        relaunched = time.monotonic() - started
        wait_until(lambda: job.running("n1.1"), 240, "n1.1 training")
        print(f"Ray node removed -> relaunched {relaunched:.2f} s, -> training {time.monotonic() - started:.2f} s")
        assert _ray_node(job, "n1.1") == hosts["n0"], "relaunched on the Ray node that is left"
        assert job.wait(timeout=400) == 0, job.logs()
        doc = job.status()
        assert doc["phase"] == "succeeded" and doc["platform"] == "ray", job.logs()
        lost = [e for e in doc["events"] if e["node"] == "n1" and e["kind"] == "lost"]
        assert lost and "Ray actor died" in lost[0]["message"], doc["events"]
        ledger = job.ledger()
        assert ledger is not None and np.all(ledger == 1), (
            f"{int((ledger == 0).sum()) if ledger is not None else '?'} missing\n{job.logs()}"
        )
    finally:
        job.stop()
