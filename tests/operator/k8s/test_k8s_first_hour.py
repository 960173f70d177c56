"""A new user's first hour on Kubernetes (issue 31): no operator running, a job spec with a relative script.

* ``streamrover run --platform k8s`` in a namespace no operator watches fails within its start timeout
  (``STREAMROVER_K8S_START_TIMEOUT``, 60 s by default; 8 s here) saying how to install one, and leaves the
  resource for an operator to come;
* a spec whose ``trainer.script`` is relative to it (``script: train.py``) runs on a pod of the node agent,
  which does not share the submitter's files: the script is removed from the submitting side once the job is
  submitted, and the pod runs the copy ``streamrover run`` shipped (a ConfigMap the resource owns, mounted
  into the node pods). A relative ``checkpoint.url`` is refused before anything is created.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrover.operator.k8s import GROUP, PLURAL, VERSION
from tests.brokers._process import free_port
from tests.helpers import wait_until, write_parquet_dataset
from tests.operator.k8s.cluster import ControlPlane
from tests.operator.k8s.conftest import AGENT_NODE, Operator, _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the first test may wait for a cold control-plane build

SCRIPT = """\
import json, os, sys
with open(sys.argv[1], "w") as out:
    json.dump({"file": os.path.abspath(__file__), "rank": os.environ.get("RANK")}, out)
"""


def _spec(name: str, tmp_path: Path, **changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name, "master": {"port": free_port()},
        "datasets": [{"name": "rows", "uri": str(tmp_path / "data"), "records_per_shard": 50}],  # (not read)
        "trainer": {"script": "train.py", "args": [str(tmp_path / "ran.json")],
                    "launcher_args": ["--standby-workers", "0", "--monitor-interval", "0.2"]},
        "checkpoint": {"url": str(tmp_path / "ckpt")},
        "restart": {"per_job": 0},  # a node that cannot run its script fails the job at once
    }  # fmt: skip
    spec.update(changes)
    if not (tmp_path / "data").exists():
        write_parquet_dataset(tmp_path / "data", rows=100, files=1, row_group_size=50)
    return spec


def _run(k8s: ControlPlane, spec_path: Path, ns: str, *extra: str, env: dict[str, str] | None = None,
         timeout: float = 120) -> tuple[int | None, str, float]:  # fmt: skip
    """``streamrover run SPEC --platform k8s -n NS``: exit code (None: running at ``timeout``), output, seconds."""
    cmd = [sys.executable, "-m", "streamrover.cli", "run", str(spec_path), "--platform", "k8s", "-n", ns, *extra]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env={**_env(), "KUBECONFIG": str(k8s.kubeconfig), "COLUMNS": "400", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out, time.monotonic() - started
    return proc.returncode, " ".join(out.split()), time.monotonic() - started


def test_run_without_an_operator_fails_in_time_saying_how_to_install_one(k8s: ControlPlane, tmp_path: Path) -> None:
    ns = "no-operator"
    k8s.core().create_namespace({"metadata": {"name": ns}})
    (tmp_path / "train.py").write_text(SCRIPT)
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(_spec("orphan", tmp_path)))
    code, out, took = _run(k8s, spec_path, ns, env={"STREAMROVER_K8S_START_TIMEOUT": "8"}, timeout=60)
    assert code is not None, f"`streamrover run --platform k8s` still waits {took:.0f} s with no operator\n{out}"
    assert code == 2 and took < 8 + 20, (code, took, out)
    assert f"no operator took StreamTrainJob 'orphan' in namespace '{ns}' within 8 s" in out, out
    assert "kubectl apply -f deploy/k8s/" in out and "k8s-overlays/plain-cluster" in out, out
    print(f"no operator -> `run` failed in {took:.1f} s (start timeout 8 s)")


def test_a_relative_script_is_shipped_to_a_pod_that_does_not_share_the_submitter_s_files(
        k8s: ControlPlane, node_agent: Any, tmp_path: Path) -> None:  # fmt: skip
    ns, name = "shipping", "shipped"
    k8s.core().create_namespace({"metadata": {"name": ns}})
    submitter = tmp_path / "submitter"  # the user's checkout: the spec and its script side by side
    submitter.mkdir()
    (submitter / "train.py").write_text(SCRIPT)
    spec_path = submitter / "job.yaml"

    spec_path.write_text(yaml.safe_dump(_spec(name, tmp_path)))
    operator = Operator(k8s, ns, "streamrover.io/agent=true")
    operator.start()
    try:
        code, out, _ = _run(k8s, spec_path, ns, "--detach")
        assert code == 0, out
        (submitter / "train.py").unlink()  # from now on only the shipped copy exists
        custom = _custom(k8s)

        def status() -> dict[str, Any]:
            return dict(custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {})

        wait_until(lambda: status().get("phase") in ("succeeded", "failed"), 300,
                   f"the job ended\n{operator.logs()}")  # fmt: skip
        assert status()["phase"] == "succeeded", (status(), operator.logs())
        ran = json.loads((tmp_path / "ran.json").read_text())
        pod_dir = k8s.root / "agent" / ns / f"{name}-n0"  # the node agent's directory of pod shipped-n0
        assert ran["file"] == str(pod_dir / "mounts/var/run/streamrover/job/train.py"), ran
        assert k8s.core().read_namespaced_pod(f"{name}-n0", ns).spec.node_name == AGENT_NODE
        files = k8s.core().read_namespaced_config_map(f"{name}-files", ns)
        assert files.data == {"train.py": SCRIPT} and files.metadata.owner_references[0].name == name

        spec_path.write_text(yaml.safe_dump(_spec("refused", tmp_path, checkpoint={"url": "ckpt"})))
        code, out, _ = _run(k8s, spec_path, ns, "--detach")
        assert code == 2 and "checkpoint.url: 'ckpt' is a path on this machine" in out, out
    finally:
        operator.proc.stop(timeout=30)


def _custom(k8s: ControlPlane) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(k8s.api())
