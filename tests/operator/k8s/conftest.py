"""Fixtures: a real control plane (one per session), the install manifests applied, the test node agent, operators.

The operator runs as a local process (kopf) with the ``streamrover-operator`` ServiceAccount's token,
so the RBAC of ``deploy/k8s/20-rbac.yaml`` is what it may do. The manifests are installed with kubectl by the commands
of docs/guide/kubernetes.md (its ``install`` session). Two namespaces, one operator each:
``lifecycle`` (worker pods on the kwok node: scheduled and "Running", nothing executes; the master
on the node agent) and ``training`` (everything on the node agent, which runs it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokers._process import ChildProcess, free_port, repo_root, wait_until
from tests.operator.k8s.cluster import ControlPlane, k8s_binaries, node_ready

AGENT_NODE = "agent-node-0"
DEPLOY = repo_root() / "deploy" / "k8s"


def service_account_kubeconfig(cp: ControlPlane, namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig with a token of the ServiceAccount ``namespace/name`` (TokenRequest API)."""
    from kubernetes import client

    request = {"spec": {"audiences": ["https://kubernetes.default.svc.cluster.local"], "expirationSeconds": 86400}}
    token = cp.core().create_namespaced_service_account_token(name, namespace, request).status.token
    path.write_text(cp.kubeconfig.read_text().replace(
        next(line.split('token: "')[1].split('"')[0] for line in cp.kubeconfig.read_text().splitlines()
             if 'token: "' in line), token))  # fmt: skip
    assert client  # the client is what made the request
    return path


@pytest.fixture(scope="session")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(tmp_path_factory.mktemp("k8s"), k8s_binaries())
    try:
        cp.start()
        times = cp.started_in
        print(f"control plane: apiserver ready in {times['apiserver']:.1f} s, all in {times['all']:.1f} s")
        api = cp.api()
        install_as_the_guide_says(cp)
        from kubernetes import client

        ext = client.ApiextensionsV1Api(api)
        wait_until("the StreamTrainJob CRD established", lambda: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition("streamtrainjobs.streamrover.io").status.conditions or []),
            timeout=60, procs=cp.procs)  # fmt: skip
        accounts = cp.core().list_namespaced_service_account
        for ns in ("lifecycle", "training"):
            cp.core().create_namespace({"metadata": {"name": ns}})
            wait_until(f"the default ServiceAccount of {ns}", lambda ns=ns: bool(accounts(
                ns, field_selector="metadata.name=default").items), timeout=60, procs=cp.procs)  # fmt: skip
        yield cp
    finally:
        cp.stop()


def guide_env(cp: ControlPlane) -> dict[str, str]:
    """What the Kubernetes guide page's commands run with: kubectl and streamrover on PATH, the cluster's KUBECONFIG."""
    import os

    env = _env()
    env["PATH"] = os.pathsep.join([str(cp.bin), str(Path(sys.executable).parent), env.get("PATH", "")])
    env["KUBECONFIG"] = str(cp.kubeconfig)
    for key in ("STREAMROVER_MASTER", "STREAMROVER_TOKEN", "STREAMROVER_PLATFORM"):
        env.pop(key, None)
    return env


def install_as_the_guide_says(cp: ControlPlane) -> None:
    """Run the ``install`` session of docs/guide/kubernetes.md (kubectl apply of deploy/k8s and its overlay).

    Before any node agent registers, so the operator's Deployment lands on the kwok node: "Running", nothing
    executes (no image here); the tests run the operator as a process with its ServiceAccount instead.
    ``cp.guide_blocks_run`` records the page's lines that ran (tests/operator/k8s/test_k8s_guide.py checks them).
    """
    from tests.docs.blocks import GUIDE, parse
    from tests.docs.runner import Session

    cwd = cp.root / "guide-install"
    cwd.mkdir()
    (cwd / "deploy").symlink_to(repo_root() / "deploy")  # the commands name deploy/k8s/ in the user's checkout
    session = Session("install", cwd, guide_env(cp))
    try:
        for block in parse(GUIDE / "kubernetes.md"):
            if block.session == "install" and block.not_run is None:
                session.run(block)
                cp.guide_blocks_run.append(block.line)
    finally:
        session.close()
    from kubernetes import client

    apps = client.AppsV1Api(cp.api())

    def rolled_out() -> bool:  # the overlay's new ReplicaSet: its pod bound (to kwok) and ready
        d = apps.read_namespaced_deployment("streamrover-operator", "streamrover-system")
        st = d.status
        return bool(st and st.observed_generation == d.metadata.generation and st.updated_replicas == 1
                    and st.ready_replicas == 1 and not st.unavailable_replicas)  # fmt: skip

    wait_until("the operator's Deployment rolled out on the kwok node", rolled_out, timeout=120, procs=cp.procs)


@pytest.fixture(scope="session")
def node_agent(k8s: ControlPlane) -> Iterator[ChildProcess]:
    """The stand-in kubelet of node ``agent-node-0`` (runs its pods as local processes)."""
    agent = ChildProcess("node-agent", [
        sys.executable, "-m", "tests.operator.k8s.node_agent", "--kubeconfig", str(k8s.kubeconfig),
        "--node", AGENT_NODE, "--workdir", str(k8s.root / "agent"),
    ], k8s.root / "logs" / "node-agent.log", cwd=repo_root(), env=_env())  # fmt: skip
    agent.start()
    try:
        core = k8s.core()
        wait_until("the agent's node Ready", lambda: node_ready(core.read_node(AGENT_NODE)), timeout=120,
                   procs=[agent, *k8s.procs])  # fmt: skip
        yield agent
    finally:
        agent.stop(timeout=30)


class Operator:
    """The kopf operator as a local process, watching one namespace."""

    def __init__(self, k8s: ControlPlane, namespace: str, worker_selector: str) -> None:
        self.k8s, self.namespace = k8s, namespace
        kubeconfig = service_account_kubeconfig(k8s, "streamrover-system", "streamrover-operator",
                                                k8s.root / f"operator-{namespace}.kubeconfig")  # fmt: skip
        env = {
            **_env(), "KUBECONFIG": str(kubeconfig), "STREAMROVER_K8S_PYTHON": sys.executable,
            "STREAMROVER_K8S_MASTER_HOST": "127.0.0.1", "STREAMROVER_K8S_MASTER_BIND": "127.0.0.1",
            "STREAMROVER_K8S_JOURNAL_HOST_DIR": str(k8s.root / "journals"),
            "STREAMROVER_K8S_MASTER_NODE_SELECTOR": "streamrover.io/agent=true",
            "STREAMROVER_K8S_NODE_SELECTOR": worker_selector,
            "STREAMROVER_K8S_WORKDIR": str(k8s.root / f"operator-{namespace}"),
        }  # fmt: skip
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        self.proc = ChildProcess(f"operator-{namespace}", [
            sys.executable, "-m", "streamrover.operator.k8s_operator", "--namespace", namespace,
            "--liveness", self.liveness,
        ], k8s.root / "logs" / f"operator-{namespace}.log", cwd=repo_root(), env=env)  # fmt: skip

    def start(self) -> None:
        import requests

        self.proc.start()
        wait_until("the operator live", lambda: requests.get(self.liveness, timeout=2).ok, timeout=120,
                   procs=[self.proc])  # fmt: skip

    def logs(self) -> str:
        return self.proc.log_tail(60)


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), env.get("PYTHONPATH", "")])
    return env
