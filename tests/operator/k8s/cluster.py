"""A real Kubernetes control plane for the tests: etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kwok.

The binaries are built from Go modules by ``scripts/build-k8s.sh`` (``make test``'s set-up starts
that build in the background; :func:`k8s_binaries` waits for it, or builds them if nothing did, and
fails naming the build log if the build failed). Nothing here runs a container: kwok marks pods on
its fake nodes Running, and the test node agent (``node_agent.py``) runs the pods bound to its node
as local processes. Every process is a :class:`~tests.brokers._process.ChildProcess` (own session,
dies with the test run).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from tests.brokers._process import (
    ChildProcess,
    MissingDependencyError,
    free_ports,
    repo_root,
    wait_until,
)

TOKEN = "streamrover-test-admin-token"
KWOK_NODE = "kwok-node-0"
BUILD_TIMEOUT = 3600.0  # a cold build on a loaded 2-core machine


def k8s_binaries(timeout: float = BUILD_TIMEOUT) -> Path:
    """The directory of the built control-plane binaries, waiting for (or running) ``scripts/build-k8s.sh``."""
    script = repo_root() / "scripts" / "build-k8s.sh"
    bin_dir = Path(subprocess.run(["bash", str(script), "--bin-dir"], capture_output=True, text=True,
                                  check=True).stdout.strip())  # fmt: skip
    if not ((bin_dir / ".complete").exists() and (bin_dir / "kubectl").exists()):
        proc = subprocess.run(["bash", str(script), "--wait"], capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
        if proc.returncode != 0 or not (bin_dir / "kubectl").exists():
            raise MissingDependencyError(
                f"the Kubernetes binaries are not in {bin_dir}: `scripts/build-k8s.sh --wait` exited "
                f"{proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    return bin_dir


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate, the service-account key pair and the static admin token."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
             "-subj", "/CN=streamrover-test-ca", cwd=pki)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=pki)  # fmt: skip
    (pki / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "30", "-extfile", "ext.cnf", cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    (pki / "tokens.csv").write_text(f"{TOKEN},streamrover-admin,streamrover-admin,system:masters\n")


class ControlPlane:
    """The processes of one local cluster under ``root``; ``kubeconfig`` is what clients use."""

    def __init__(self, root: Path, bin_dir: Path) -> None:
        self.root, self.bin = root, bin_dir
        self.guide_blocks_run: list[int] = []  # lines of docs/guide/kubernetes.md run against this cluster
        self.pki = root / "pki"
        self.kubeconfig = root / "kubeconfig"
        self._api: Any = None
        etcd, peer, self.port, kwok = free_ports(4)
        self.etcd_url = f"http://127.0.0.1:{etcd}"
        self.server = f"https://127.0.0.1:{self.port}"
        logs = root / "logs"
        p = self.pki
        self.etcd = ChildProcess("etcd", [
            str(bin_dir / "etcd"), "--name", "test", "--data-dir", str(root / "etcd"), "--log-level=warn",
            "--unsafe-no-fsync", "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"test=http://127.0.0.1:{peer}",
        ], logs / "etcd.log")  # fmt: skip
        self.apiserver = ChildProcess("kube-apiserver", [
            str(bin_dir / "kube-apiserver"), f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={self.port}", f"--tls-cert-file={p}/apiserver.crt",
            f"--tls-private-key-file={p}/apiserver.key", f"--client-ca-file={p}/ca.crt",
            f"--token-auth-file={p}/tokens.csv", "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={p}/sa.pub", f"--service-account-signing-key-file={p}/sa.key",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24", f"--cert-dir={root}/apiserver-certs",
        ], logs / "apiserver.log")  # fmt: skip
        kc = f"--kubeconfig={self.kubeconfig}"
        self.kcm = ChildProcess("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), kc, "--leader-elect=false", "--secure-port=0",
            f"--service-account-private-key-file={p}/sa.key", f"--root-ca-file={p}/ca.crt",
            "--use-service-account-credentials=false", "--controllers=*", "--cluster-cidr=10.244.0.0/16",
        ], logs / "kcm.log")  # fmt: skip
        self.scheduler = ChildProcess("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), kc, f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
            "--secure-port=0",
        ], logs / "scheduler.log")  # fmt: skip
        # kwok manages only the nodes annotated kwok.x-k8s.io/node=fake (the node agent's node is not)
        self.kwok = ChildProcess("kwok", [
            str(bin_dir / "kwok"), kc, "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--cidr=10.244.0.0/16",
            "--node-ip=10.1.0.1", f"--server-address=127.0.0.1:{kwok}", f"--config={bin_dir}/kwok-stages.yaml",
        ], logs / "kwok.log")  # fmt: skip
        self.procs = [self.etcd, self.apiserver, self.kcm, self.scheduler, self.kwok]
        self.started_in: dict[str, float] = {}

    def start(self, timeout: float = 180.0) -> None:
        """Start every process and wait until the API server is ready, a fake node Ready and pods admissible."""
        import requests

        make_pki(self.pki)
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: test, cluster: {{server: \"{self.server}\", "
            f"certificate-authority: \"{self.pki}/ca.crt\"}}}}]\n"
            f"users: [{{name: admin, user: {{token: \"{TOKEN}\"}}}}]\n"
            "contexts: [{name: test, context: {cluster: test, user: admin, namespace: default}}]\n"
            "current-context: test\n"
        )
        t0 = time.monotonic()
        self.etcd.start()
        wait_until("etcd healthy", lambda: "true" in requests.get(f"{self.etcd_url}/health", timeout=2).text,
                   timeout=timeout, procs=[self.etcd])  # fmt: skip
        self.apiserver.start()
        headers = {"Authorization": f"Bearer {TOKEN}"}
        ca = str(self.pki / "ca.crt")
        wait_until("kube-apiserver /readyz", lambda: requests.get(
            f"{self.server}/readyz", headers=headers, verify=ca, timeout=5).text == "ok",
            timeout=timeout, procs=[self.etcd, self.apiserver])  # fmt: skip
        self.started_in["apiserver"] = time.monotonic() - t0
        for proc in (self.kcm, self.scheduler, self.kwok):
            proc.start()
        core = self.core()
        core.create_node(fake_node(KWOK_NODE))
        wait_until("the kwok node Ready", lambda: node_ready(core.read_node(KWOK_NODE)), timeout=timeout,
                   procs=self.procs)  # fmt: skip
        # without the controller-manager's default ServiceAccount, pod creation is refused (403)
        wait_until("the default ServiceAccount", lambda: bool(core.list_namespaced_service_account(
            "default", field_selector="metadata.name=default").items), timeout=timeout, procs=self.procs)  # fmt: skip
        self.started_in["all"] = time.monotonic() - t0

    def api(self) -> Any:
        """The test's kubernetes ``ApiClient`` for this cluster (one: each holds a connection pool)."""
        from kubernetes import config

        if self._api is None:
            self._api = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api())

    def check_alive(self) -> None:
        """Fail naming the control-plane process that died (with its log's tail)."""
        for p in self.procs:
            if not p.running():
                raise AssertionError(f"{p.name} exited ({p.returncode()}):\n{p.log_tail()}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=15)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in self.procs)


def fake_node(name: str, labels: dict[str, str] | None = None, kwok: bool = True) -> dict[str, Any]:
    """A Node object; ``kwok=True``: annotated so kwok runs its lifecycle (Ready, pods Running)."""
    annotations = {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"} if kwok else {}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": annotations,
                     "labels": {"kubernetes.io/hostname": name, "type": "kwok" if kwok else "agent", **(labels or {})}},
        "status": {"allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110"},
                   "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110"}},
    }  # fmt: skip


def node_ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
