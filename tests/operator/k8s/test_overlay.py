"""``deploy/k8s/overlays/plain-cluster``: the settings for a cluster without DNS, provisioner or token mounts.

No kustomize binary runs here, so the overlay is built the way kustomize builds it, for what it uses (the base's
``resources``, ``images``, JSON 6902 ``patches`` with a target), and the built Deployment goes to the API server
as ``kubectl apply -k --dry-run=server`` would send it (unknown fields refused). The operator then reads the
settings it expects from the built Deployment's environment.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from streamrover.operator.k8s_operator import config_from_env
from tests.operator.k8s.cluster import ControlPlane
from tests.operator.k8s.conftest import DEPLOY, apply_manifests

OVERLAY = DEPLOY / "overlays" / "plain-cluster"


def _kustomization(directory: Path) -> dict[str, Any]:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (directory / name).is_file():
            return dict(yaml.safe_load((directory / name).read_text()))
    raise AssertionError(f"{directory}: no kustomization")


def _pointer_add(doc: Any, path: str, value: Any) -> None:
    *parents, last = path.lstrip("/").split("/")
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    if isinstance(doc, list):
        doc.append(value) if last == "-" else doc.insert(int(last), value)
    else:
        doc[last] = value


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build directory`` makes (resources, images, JSON 6902 patches: what deploy/k8s uses)."""
    k = _kustomization(directory)
    assert set(k) <= {"apiVersion", "kind", "resources", "images", "patches", "replacements"}, f"{directory}: more"
    objects: list[dict[str, Any]] = []
    for ref in k.get("resources", []):
        path = (directory / ref).resolve()
        assert path.is_relative_to(DEPLOY.resolve()), f"{ref}: kustomize loads nothing outside the tree"
        objects += build(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    objects = copy.deepcopy(objects)
    for image in k.get("images", []):
        for obj in objects:
            for c in (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in k.get("patches", []):
        target, ops = patch["target"], yaml.safe_load((directory / patch["path"]).read_text())
        hits = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch {patch['path']}: target {target} matches {len(hits)} objects"
        for op in ops:
            assert op["op"] == "add", op
            _pointer_add(hits[0], op["path"], op["value"])
    for replacement in k.get("replacements", []):  # the one shape used: a container's image into an env value
        source = replacement["source"]
        (obj,) = [o for o in objects if o["kind"] == source["kind"] and o["metadata"]["name"] == source["name"]]
        assert source["fieldPath"] == "spec.template.spec.containers.0.image", source
        value = obj["spec"]["template"]["spec"]["containers"][0]["image"]
        for target in replacement["targets"]:
            for path in target["fieldPaths"]:
                name = path.split("[name=")[1].split("]")[0]
                assert path == f"spec.template.spec.containers.0.env.[name={name}].value", path
                (var,) = [e for e in obj["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == name]
                var["value"] = value
    return objects


def test_the_plain_cluster_overlay_is_a_valid_deployment_with_the_settings_the_operator_reads(
        k8s: ControlPlane, tmp_path: Path) -> None:  # fmt: skip
    objects = build(OVERLAY)
    assert [o["kind"] for o in objects] == [o["kind"] for o in build(DEPLOY)], "the overlay keeps every object"
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    built = tmp_path / "operator.yaml"
    built.write_text(yaml.safe_dump(deployment))
    apply_manifests(k8s.api(), [built], dry_run="All", field_validation="Strict")  # refused if anything is off
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = config_from_env(env)
    assert config.master_host == "cluster-ip" and config.journal_host_dir == "/var/lib/streamrover/journals"
    assert config.master_node_selector == {"kubernetes.io/hostname": "node-1"}
    assert container["image"] == env["STREAMROVER_K8S_IMAGE"] == "streamrover:0.1.0"
    assert pod["automountServiceAccountToken"] is False
    assert container["volumeMounts"][0]["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
