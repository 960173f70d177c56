"""``deploy/k8s-overlays/plain-cluster``: the settings for a cluster without DNS, provisioner or token mounts.

The guide's install commands (docs/guide/kubernetes.md, run by the ``k8s`` fixture with kubectl) applied the base
and then this overlay to the real API server; kubectl's own kustomize built it. Here: the overlay keeps every
object of the base, and the Deployment the API server now holds carries the settings the operator reads.
"""

from __future__ import annotations

import subprocess

import yaml

from streamrover.operator.k8s_operator import config_from_env
from tests.operator.k8s.cluster import ControlPlane
from tests.operator.k8s.conftest import DEPLOY

OVERLAY = DEPLOY.parent / "k8s-overlays" / "plain-cluster"


def _kustomize(k8s: ControlPlane, directory: str) -> list[dict]:
    out = subprocess.run([str(k8s.bin / "kubectl"), "kustomize", directory], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return [o for o in yaml.safe_load_all(out) if o]


def test_the_plain_cluster_overlay_is_applied_with_the_settings_the_operator_reads(k8s: ControlPlane) -> None:
    from kubernetes import client

    overlay = _kustomize(k8s, str(OVERLAY))
    base = [o for p in sorted(DEPLOY.glob("*.yaml")) for o in yaml.safe_load_all(p.read_text()) if o]
    base_kinds = sorted(o["kind"] for o in base)
    assert sorted(o["kind"] for o in overlay) == base_kinds, "the overlay keeps every object of the base"
    assert k8s.guide_blocks_run, "the guide's install commands did not run"
    live = client.AppsV1Api(k8s.api()).read_namespaced_deployment("streamrover-operator", "streamrover-system")
    pod = live.spec.template.spec
    (container,) = pod.containers
    env = {e.name: e.value for e in container.env if e.value is not None}
    config = config_from_env(env)
    assert config.master_host == "cluster-ip" and config.journal_host_dir == "/var/lib/streamrover/journals"
    assert config.master_node_selector == {"kubernetes.io/hostname": "node-1"}
    assert container.image == env["STREAMROVER_K8S_IMAGE"] == "streamrover:0.1.0"
    assert pod.automount_service_account_token is False
    assert container.volume_mounts[0].mount_path == "/var/run/secrets/kubernetes.io/serviceaccount"
    (volume,) = pod.volumes
    assert [s.service_account_token.path for s in volume.projected.sources if s.service_account_token] == ["token"]
