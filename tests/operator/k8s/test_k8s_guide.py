"""docs/guide/kubernetes.md, command by command, with kubectl against the real control plane.

The ``k8s`` fixture ran the page's ``install`` session (``kubectl apply -f deploy/k8s/``, the rollout, the
plain-cluster overlay) before any node agent registered. This test runs the rest of the page in order, in one
working directory: the training script and the job spec are written, ``streamrover run ... --detach`` submits
the job, and the watch/scale/stop commands act on it. What this machine lacks, and what stands in for it:

* no container runtime: the image block is not run; the operator's Deployment "runs" on the kwok node, and the
  operator itself runs as a process with the Deployment's ServiceAccount (``Operator``, watching ``default``);
  the job's pods run as processes of the node agent (the kubelet stand-in);
* no cluster DNS or S3: the spec's ``kafka.data.svc:9092/clicks`` becomes the test's Kafka broker and a fresh
  topic holding 2,000 records, and ``s3://models/clicks`` a directory (every pod here shares this filesystem).

Between the ``run`` and the watch commands the test waits until the job has acked all 2,000 records (the
resource's status), so ``status`` and ``scale`` act on a training job; after ``stop`` the job's phase is
``stopped`` and the resource stays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrover.operator.k8s import GROUP, PLURAL, VERSION
from tests.docs.blocks import GUIDE, parse
from tests.docs.runner import Session
from tests.helpers import wait_until
from tests.operator.k8s.cluster import ControlPlane
from tests.operator.k8s.conftest import Operator, guide_env
from tests.operator.runner import kafka_topic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the first test may wait for a cold control-plane build

RECORDS = 2000
PAGE = "kubernetes.md"


def test_the_kubernetes_page_runs_command_by_command(k8s: ControlPlane, node_agent: Any, kafka_broker: Any,
                                                    tmp_path: Path) -> None:  # fmt: skip
    from kubernetes import client

    blocks = parse(GUIDE / PAGE)
    runnable = [b for b in blocks if b.not_run is None and b.lang != "text"]
    assert {b.session for b in runnable} == {"install", "job"}, "every command of the page is in a session"
    assert k8s.guide_blocks_run == [b.line for b in runnable if b.session == "install"]

    topic = kafka_topic(kafka_broker, RECORDS)
    custom = client.CustomObjectsApi(k8s.api())

    def status() -> dict[str, Any]:
        job = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "clicks")
        return dict(job.get("status") or {})

    operator = Operator(k8s, "default", "streamrover.io/agent=true")
    operator.start()
    cwd = tmp_path / "user"
    cwd.mkdir()
    session = Session("job", cwd, guide_env(k8s))
    try:
        for block in (b for b in runnable if b.session == "job"):
            if "streamrover stop" in block.code:  # the watch/scale/stop block: the job has trained by now
                wait_until(lambda: status().get("recordsAcked") == RECORDS, 300,
                           f"the job acked all {RECORDS} records\n{status()}\n{operator.logs()}")  # fmt: skip
            session.run(block)
            if block.file == "job.yaml":
                spec = cwd / "job.yaml"
                text = spec.read_text()
                for there, here in (("kafka.data.svc:9092/clicks", f"{kafka_broker.bootstrap}/{topic}"),
                                    ("s3://models/clicks", str(tmp_path / "checkpoints"))):  # fmt: skip
                    assert there in text, f"{PAGE}'s job spec no longer names {there}: update this test"
                    text = text.replace(there, here)
                spec.write_text(text)
        wait_until(lambda: status().get("phase") == "stopped", 120, f"the job stopped\n{status()}")
        out = " ".join(session.log.read_text().split())
        assert "StreamTrainJob created in namespace default" in out, out  # run
        assert "│ clicks │ running │ k8s │ 1/1 │" in out, out  # jobs list
        assert "job clicks running platform k8s namespace default" in out and f"acked {RECORDS}" in out, out  # status
        assert "job 'clicks': asked for 2 nodes" in out, out  # scale
        assert "NAME PHASE NODES LAG CHECKPOINT AGE clicks running" in out, out  # kubectl get
        assert "stopping job 'clicks'" in out, out  # stop
        assert status().get("recordsAcked") == RECORDS, status()
        assert custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "clicks")["spec"]["replicas"] == 2
    finally:
        session.close()
        operator.proc.stop(timeout=30)
