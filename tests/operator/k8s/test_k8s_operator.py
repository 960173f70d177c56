"""The ``k8s`` platform against a real API server: the operator, its pods, relaunch, scale, garbage collection.

* lifecycle (namespace ``lifecycle``, worker pods on the kwok node: scheduled, "Running", nothing
  executes; the master runs on the node agent): a ``StreamTrainJob`` applied -> master pod, service,
  secret and worker pods, all owned by it; a worker pod deleted -> a new one for its slot; the
  scale subresource (``streamrover jobs scale --platform k8s``, and a direct patch) -> the pod count
  follows up and down; ``streamrover jobs status|list|stop --platform k8s`` read the status
  subresource and stop a second job gracefully (its pods gone, the resource kept, phase stopped);
  the operator SIGKILLed and the resource deleted -> the controller-manager's garbage collector
  deletes every pod, service and secret;
* training (namespace ``training``, everything on the node agent, which runs the pods as local
  processes in a memory cgroup of the pod's limit): ``streamrover run job.yaml --platform k8s`` -> the
  torch ledger job trains from Kafka to an exact ledger; its worker pod deleted mid-run is relaunched;
  then a worker allocates past the pod's memory limit: the kernel OOM-kills it, the agent reports the
  container ``OOMKilled`` (exit 137) as a kubelet would, and the operator relaunches the node in a pod
  with twice the limit; the ledger is still exact. That job's master serves mutual TLS from Secrets in
  cert-manager's layout (``master.tls.secret``/``client_secret``): the workers and the operator's controller
  reach it only through TLS with the job's client certificate;
* a ``<job>-token`` Secret made by an operator older than the roles gets its ``worker-token`` on resume.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from streamrover.operator.k8s import GROUP, LABEL_JOB, LABEL_NODE, LABEL_ROLE, PLURAL, VERSION, pod_name, submit
from streamrover.operator.k8s_tls import server_name
from streamrover.operator.spec import parse_spec
from streamrover.testing.certs import issue, make_ca
from tests.brokers._process import free_port
from tests.helpers import wait_until, write_parquet_dataset
from tests.operator.k8s.cluster import ControlPlane
from tests.operator.k8s.conftest import Operator, _env
from tests.operator.runner import kafka_topic, ledger_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the first test may wait for a cold control-plane build


def _custom(k8s: ControlPlane) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(k8s.api())


def _job(k8s: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return dict(_custom(k8s).get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name))


def _pods(k8s: ControlPlane, ns: str, job: str, role: str = "node", phase: str | None = "Running") -> list[Any]:
    pods = k8s.core().list_namespaced_pod(ns, label_selector=f"{LABEL_JOB}={job},{LABEL_ROLE}={role}").items
    return [p for p in pods if p.metadata.deletion_timestamp is None and (phase is None or p.status.phase == phase)]


def _names(pods: list[Any]) -> set[str]:
    return {p.metadata.name for p in pods}


def _owned(obj: Any, uid: str) -> bool:
    refs = obj.metadata.owner_references or []
    return any(r.uid == uid and r.kind == "StreamTrainJob" and r.controller for r in refs)


def _cli(k8s: ControlPlane, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``streamrover ARGV --kubeconfig K`` in this process: its exit code and what it printed."""
    from streamrover.cli import main

    capsys.readouterr()
    code = main([*argv, "--kubeconfig", str(k8s.kubeconfig)])
    out = capsys.readouterr()
    return code, " ".join(re.sub("[\u2500-\u257f]", " ", out.out + out.err).split())  # no table borders


def test_pods_are_owned_relaunched_scaled_and_garbage_collected(k8s: ControlPlane, node_agent: Any, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    ns, name, other = "lifecycle", "life", "life-stopped"
    write_parquet_dataset(tmp_path / "data", rows=4000, files=2, row_group_size=500)

    def spec(job: str) -> dict[str, Any]:
        return {
            "name": job, "master": {"lease_ttl": 10, "port": free_port()},
            "datasets": [{"name": "rows", "uri": str(tmp_path / "data"), "records_per_shard": 500}],
            "trainer": {"script": str(tmp_path / "never-run.py"), "nodes": "1:3"},
            "checkpoint": {"url": str(tmp_path / f"ckpt-{job}")},
            "restart": {"heartbeat_timeout": 3600},  # kwok pods run nothing: no agent heartbeat
        }  # fmt: skip

    operator = Operator(k8s, ns, "type=kwok")
    operator.start()
    core = k8s.core()
    k8s_args = ("--platform", "k8s", "-n", ns)
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps and folds to the terminal's width
    try:
        submit(parse_spec(spec(name)), ns, k8s.api(), replicas=2)
        submit(parse_spec(spec(other)), ns, k8s.api(), replicas=1)  # stopped below with `streamrover stop`
        uid = _job(k8s, ns, name)["metadata"]["uid"]
        wait_until(lambda: _names(_pods(k8s, ns, name)) == {f"{name}-n0", f"{name}-n1"}, 120,
                   f"two worker pods Running\n{operator.logs()}")  # fmt: skip
        masters = _pods(k8s, ns, name, "master")
        assert len(masters) == 1 and masters[0].spec.node_name == "agent-node-0", masters
        workers = _pods(k8s, ns, name)
        assert {p.spec.node_name for p in workers} == {"kwok-node-0"}
        for obj in [*masters, *workers, core.read_namespaced_service(f"{name}-master", ns),
                    core.read_namespaced_secret(f"{name}-token", ns)]:  # fmt: skip
            assert _owned(obj, uid), (obj.metadata.name, obj.metadata.owner_references)
        token_env = next(e for e in workers[0].spec.containers[0].env if e.name == "STREAMROVER_TOKEN")
        assert token_env.value is None and token_env.value_from.secret_key_ref.name == f"{name}-token"
        wait_until(lambda: (_job(k8s, ns, name).get("status") or {}).get("replicas") == 2, 60, "status.replicas 2")
        assert _job(k8s, ns, name)["status"]["phase"] == "running"
        # the status's nodes say what their pods say: Running, with no detail left over from their Pending start
        wait_until(lambda: [n["state"] for n in _job(k8s, ns, name)["status"]["nodes"]] == ["running"] * 2, 60,
                   "both nodes running in the status")  # fmt: skip
        nodes = {n["node"]: n for n in _job(k8s, ns, name)["status"]["nodes"]}
        for pod in _pods(k8s, ns, name):
            assert (nodes[pod.metadata.labels[LABEL_NODE]]["detail"], pod.status.phase) == ("", "Running"), nodes

        core.delete_namespaced_pod(f"{name}-n1", ns, grace_period_seconds=0)
        wait_until(lambda: _names(_pods(k8s, ns, name)) == {f"{name}-n0", f"{name}-n1-1"}, 120,
                   f"n1's pod relaunched as n1.1\n{operator.logs()}")  # fmt: skip
        assert _owned(_pods(k8s, ns, name)[0], uid)
        wait_until(lambda: any(e.startswith("launch n1.1: relaunch of n1 (lost)")
                               for e in _job(k8s, ns, name)["status"].get("events", [])), 60, "the relaunch event")

        custom = _custom(k8s)
        assert _cli(k8s, capsys, "jobs", "scale", name, "4", *k8s_args) == (
            2, f"error: 4 nodes is outside job '{name}''s bounds 1:3")
        assert _cli(k8s, capsys, "jobs", "scale", name, "3", *k8s_args) == (0, f"job '{name}': asked for 3 nodes")
        wait_until(lambda: len(_pods(k8s, ns, name)) == 3, 120, "three worker pods")
        assert custom.get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, name)["spec"]["replicas"] == 3
        wait_until(lambda: _job(k8s, ns, name)["status"].get("replicas") == 3, 60, "status.replicas 3")
        code, out = _cli(k8s, capsys, "status", name, "--json", *k8s_args)
        assert code == 0 and json.loads(out)["replicas"] == 3 and json.loads(out)["phase"] == "running", out
        code, out = _cli(k8s, capsys, "jobs", "status", name, *k8s_args)
        assert code == 0 and f"job {name} running" in out and "nodes 3/3 (1:3)" in out and "n1.1" in out, out
        assert _cli(k8s, capsys, "jobs", "status", "nosuch", *k8s_args) == (
            2, f"error: no StreamTrainJob 'nosuch' in namespace '{ns}' (jobs: {name}, {other})")

        # stop = the local `stop`: the nodes leave, then the master; the resource (and its status) stays
        wait_until(lambda: len(_pods(k8s, ns, other)) == 1, 120, f"{other}'s worker pod Running")
        monkeypatch.setenv("STREAMROVER_PLATFORM", "k8s")  # the platform from the environment, not --platform
        assert _cli(k8s, capsys, "stop", other, "-n", ns) == (
            0, f"stopping job '{other}' (its nodes leave, then the master)")
        monkeypatch.delenv("STREAMROVER_PLATFORM")
        wait_until(lambda: (_job(k8s, ns, other).get("status") or {}).get("phase") == "stopped", 120,
                   f"{other} stopped\n{operator.logs()}")  # fmt: skip
        wait_until(lambda: not core.list_namespaced_pod(ns, label_selector=f"{LABEL_JOB}={other}").items, 60,
                   f"{other}'s pods gone (the master's deletion is asked last)")  # fmt: skip
        assert _job(k8s, ns, other)["status"]["reason"] == "stopped on request"
        assert _cli(k8s, capsys, "jobs", "stop", other, *k8s_args) == (0, f"job '{other}' is not running (stopped)")
        assert _cli(k8s, capsys, "jobs", "scale", other, "2", *k8s_args) == (
            2, f"error: job '{other}' is not running (stopped)")
        code, out = _cli(k8s, capsys, "jobs", "list", *k8s_args)
        assert code == 0 and f"{name} running k8s 3/3" in out and f"{other} stopped k8s 0/" in out, out

        custom.patch_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, name, {"spec": {"replicas": 1}})
        wait_until(lambda: _names(_pods(k8s, ns, name, phase=None)) == {f"{name}-n0"}, 180, "one worker pod left")
        wait_until(lambda: _job(k8s, ns, name)["status"].get("replicas") == 1, 60, "status.replicas 1")
        scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, name)
        assert scale["status"]["replicas"] == 1, scale

        # the operator is gone (SIGKILL), so only the garbage collector can delete what the resource owns
        operator.proc.kill()
        custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"metadata": {"finalizers": None}})
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        started = time.monotonic()
        selector = f"{LABEL_JOB}={name}"
        wait_until(lambda: not core.list_namespaced_pod(ns, label_selector=selector).items
                   and not core.list_namespaced_service(ns, label_selector=selector).items
                   and not core.list_namespaced_secret(ns, label_selector=selector).items, 120,
                   f"the job's pods, service and secret garbage-collected\n{k8s.logs()}")  # fmt: skip
        print(f"resource deleted -> its objects garbage-collected in {time.monotonic() - started:.2f} s")
    finally:
        operator.proc.stop(timeout=30)


RECORDS = 8_000


def test_the_ledger_job_trains_exactly_through_k8s_and_survives_its_pod_deleted(
        k8s: ControlPlane, node_agent: Any, tmp_path: Path, kafka_broker: Any) -> None:  # fmt: skip
    ns, name = "training", "ledger"
    topic = kafka_topic(kafka_broker, RECORDS)
    out = tmp_path / "out"
    out.mkdir()
    hog = tmp_path / "hog"  # once it exists, rank 0 holds 1 GiB more (tests/operator/hog_ledger_train.py)
    spec = ledger_spec(name, f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, out, nodes=1, nproc_per_node=1,
                       memory="1536Mi", env={"HOG_FILE": str(hog), "HOG_MB": "1024"})  # fmt: skip
    spec["trainer"]["launcher_args"] += ["--standby-workers", "0"]  # a smaller node: agent + one worker
    # the job ends once this file says how many records there are, written below when the pod was deleted and
    # OOM-killed: 8,000 records train in seconds, and a job that had finished by then could not be relaunched
    until = out / "produced"
    spec["trainer"]["args"] += ["--until-file", str(until)]
    spec["restart"] = {"oom": {"factor": 2, "max_memory": "3Gi"}}
    spec["checkpoint"]["url"] = str(tmp_path / "ckpt")
    spec["master"]["port"] = free_port()
    # the master serves mutual TLS from cert-manager-style Secrets; workers and the controller train through it
    spec["master"]["tls"] = tls_secrets(k8s, ns, name, tmp_path / "pki")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    operator = Operator(k8s, ns, "streamrover.io/agent=true")
    operator.start()
    env = {**_env(), "KUBECONFIG": str(k8s.kubeconfig)}
    run = subprocess.Popen([sys.executable, "-m", "streamrover.cli", "run", str(tmp_path / "job.yaml"),
                            "--platform", "k8s", "--namespace", ns], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)  # fmt: skip

    custom = _custom(k8s)  # one client: a new one per poll leaks its connection pool (fds run out)

    def status() -> dict[str, Any]:
        try:
            found = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
            return dict(found.get("status") or {})
        except Exception:  # not created yet
            return {}

    try:
        wait_until(lambda: (status().get("recordsAcked") or 0) >= 0.3 * RECORDS, 400,
                   f"30% of the records acked\n{operator.logs()}")  # fmt: skip
        assert_served_over_tls(k8s, ns, name, tmp_path / "pki", spec["master"]["port"])
        k8s.core().delete_namespaced_pod(pod_name(name, "n0"), ns, grace_period_seconds=0)
        started = time.monotonic()
        wait_until(lambda: _names(_pods(k8s, ns, name)) == {pod_name(name, "n0.1")}, 120, "n0 relaunched as n0.1")
        print(f"pod deleted -> relaunched pod running {time.monotonic() - started:.2f} s")

        hog.touch()  # n0.1's worker allocates at once: past the pod's 1.5Gi with the agent and torch
        started = time.monotonic()
        wait_until(lambda: _names(_pods(k8s, ns, name)) == {pod_name(name, "n0.2")}, 300,
                   f"n0.1 OOM-killed, relaunched as n0.2\n{operator.logs()}")  # fmt: skip
        print(f"over the memory limit -> relaunched pod running {time.monotonic() - started:.2f} s")
        killed = k8s.core().read_namespaced_pod(pod_name(name, "n0.1"), ns)
        terminated = killed.status.container_statuses[0].state.terminated
        assert (killed.status.phase, terminated.reason, terminated.exit_code) == ("Failed", "OOMKilled", 137)
        wait_until(lambda: any(e.startswith("oom n0.1: OOM-killed at ") and e.endswith("relaunching with 3Gi")
                               for e in status().get("events", [])), 60, "the OOM event")  # fmt: skip
        (bigger,) = _pods(k8s, ns, name)
        assert bigger.spec.containers[0].resources.limits["memory"] in ("3Gi", str(3 * 2**30)), bigger.spec
        until.with_suffix(".tmp").write_text(str(RECORDS))
        until.with_suffix(".tmp").replace(until)  # (atomically: a rank reads it as soon as it exists)
        output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, f"{output}\n{operator.logs()}"
        doc = status()
        assert doc["phase"] == "succeeded", doc
        assert any(e.startswith("lost n0") for e in doc["events"]), doc["events"]
        ledger = np.load(out / "ledger.npy")
        assert ledger.shape == (RECORDS,) and np.all(ledger == 1), (
            f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated")
        assert "lastCheckpoint" in doc and "lag" in doc, doc
    finally:
        if run.poll() is None:
            run.kill()
        operator.proc.stop(timeout=60)


def tls_secrets(k8s: ControlPlane, ns: str, job: str, pki: Path) -> dict[str, str]:
    """The Secrets cert-manager would make (tls.crt, tls.key, ca.crt): the master's for ``<job>-master.<ns>.svc``
    and the job's client certificate; the spec's ``master.tls`` naming them."""
    ca = make_ca(pki)
    pairs = {"master-tls": issue(ca, pki, "master", dns=(server_name(job, ns),)),
             "client-tls": issue(ca, pki, "client", server=False)}  # fmt: skip
    for secret, pair in pairs.items():
        data = {"tls.crt": pair.cert.read_text(), "tls.key": pair.key.read_text(), "ca.crt": ca.cert.read_text()}
        k8s.core().create_namespaced_secret(ns, {"metadata": {"name": f"{job}-{secret}"}, "type": "kubernetes.io/tls",
                                                 "stringData": data})  # fmt: skip
    return {"secret": f"{job}-master-tls", "client_secret": f"{job}-client-tls"}


def assert_served_over_tls(k8s: ControlPlane, ns: str, job: str, pki: Path, port: int) -> None:
    """The master pod serves the Secret's certificate (mutual TLS); a worker pod has the CA and the client
    certificate mounted, never the master's key."""
    import socket
    import ssl

    (master,) = _pods(k8s, ns, job, "master")
    assert "--tls-cert" in master.spec.containers[0].command, master.spec.containers[0].command
    (worker,) = _pods(k8s, ns, job)
    env = {e.name: e.value for e in worker.spec.containers[0].env}
    assert env["STREAMROVER_TLS_CA"] == "/var/run/streamrover/tls/ca.crt", env
    assert env["STREAMROVER_TLS_SERVER_NAME"] == server_name(job, ns), env
    secrets = {v.secret.secret_name: v.secret for v in worker.spec.volumes if v.secret is not None}
    assert [i.key for i in secrets[f"{job}-master-tls"].items] == ["ca.crt"], secrets
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                         server_hostname=server_name(job, ns)) as tls:  # fmt: skip
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_a_token_secret_left_by_an_older_operator_gets_the_worker_token(k8s: ControlPlane) -> None:
    import base64

    from streamrover.operator.k8s_operator import job_token
    from streamrover.tokens import worker_token

    core = k8s.core()
    core.create_namespaced_secret("training", {"metadata": {"name": "old-token"}, "stringData": {"token": "adm1n"}})
    assert job_token(k8s.api(), "training", "old") == "adm1n"
    data = core.read_namespaced_secret("old-token", "training").data
    assert base64.b64decode(data["worker-token"]).decode() == worker_token("adm1n")
    assert base64.b64decode(data["token"]).decode() == "adm1n"
