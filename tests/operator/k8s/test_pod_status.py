"""How the k8s platform reads a node's state from its pod, and the operator's configuration (no cluster)."""

from __future__ import annotations

from typing import Any

from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodStatus,
)

from streamrover.operator.api import NodeState
from streamrover.operator.k8s import pod_status
from streamrover.operator.k8s_operator import config_from_env, resource_status


def _pod(phase: str, exit_code: int | None = None, reason: str | None = None, deleting: bool = False,
         pod_reason: str | None = None) -> V1Pod:  # fmt: skip
    statuses = None
    if exit_code is not None:
        terminated = V1ContainerStateTerminated(exit_code=exit_code, reason=reason)
        statuses = [V1ContainerStatus(name="node", image="i", image_id="", ready=False, restart_count=0,
                                      state=V1ContainerState(terminated=terminated))]  # fmt: skip
    meta = V1ObjectMeta(name="p", deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None)
    return V1Pod(metadata=meta, status=V1PodStatus(phase=phase, container_statuses=statuses, reason=pod_reason))


def test_pod_phases_map_to_node_states() -> None:
    cases: list[tuple[Any, bool, NodeState]] = [
        (None, False, NodeState.LOST),  # deleted by someone else
        (None, True, NodeState.STOPPED),  # deleted by the platform (scale-in, stop)
        (_pod("Pending"), False, NodeState.PENDING),
        (_pod("Running"), False, NodeState.RUNNING),
        (_pod("Running", deleting=True), False, NodeState.LOST),
        (_pod("Succeeded", 0, "Completed"), False, NodeState.SUCCEEDED),
        (_pod("Failed", 1, "Error"), False, NodeState.FAILED),
        (_pod("Failed", 137, "Error"), False, NodeState.LOST),  # SIGKILL from outside
        (_pod("Failed", 137, "OOMKilled"), False, NodeState.OOM_KILLED),
        (_pod("Failed", pod_reason="Evicted"), False, NodeState.LOST),
    ]
    for pod, stopped, expected in cases:
        got = pod_status("n0", pod, stopped)
        assert got.state is expected, (pod and pod.status, stopped, got)
    assert pod_status("n0", _pod("Failed", 137, "OOMKilled"), False).oom_kills == 1


def test_the_operator_reads_its_layout_from_the_environment() -> None:
    cfg = config_from_env({"STREAMROVER_K8S_IMAGE": "reg/sr:1", "STREAMROVER_K8S_NODE_SELECTOR": "a=b, c=d",
                           "STREAMROVER_K8S_JOURNAL_HOST_DIR": "/j"})  # fmt: skip
    assert (cfg.image, cfg.node_selector, cfg.journal_host_dir, cfg.master_host) == (
        "reg/sr:1", {"a": "b", "c": "d"}, "/j", None)
    doc = {"phase": "running", "nodes": [{"node_id": "n0", "state": "running"}, {"node_id": "n1", "state": "stopped"}],
           "events": [{"kind": "launch", "node": "n0", "message": "initial node"}], "lag": 5}  # fmt: skip
    status = resource_status(doc)
    assert status["replicas"] == 1 and status["lag"] == 5 and status["events"] == ["launch n0: initial node"]
