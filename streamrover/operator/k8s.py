"""The ``k8s`` platform: the job master as a pod + service (journal on a volume), each node as a pod.

Used by the operator (:mod:`streamrover.operator.k8s_operator`), which runs one job controller per
``StreamTrainJob`` custom resource; every object made here is owned by that resource
(``ownerReferences``), so deleting the resource garbage-collects the job (the controller-manager
does that, not this code). A platform only launches, stops and observes: relaunch and scale are
the supervisor's decisions, the same as on the other platforms.

* master: pod ``<job>-master-<gen>`` running ``streamrover master`` with its journal on a volume
  (a PersistentVolumeClaim ``<job>-journal`` by default, or a host directory), a Service
  ``<job>-master`` in front of it, the token in a Secret ``<job>-token`` (pods read it by
  ``secretKeyRef``; it never appears in a pod spec); with ``master.tls.secret`` the certificates mounted from
  Secrets (:mod:`streamrover.operator.k8s_tls`);
* node: pod ``<job>-<node id>`` (``n1.2`` -> ``n1-2``), ``restartPolicy: Never`` (a relaunch is a new
  node id), memory as the container's limit, CPU as its request;
* observed: the pod's phase; ``OOMKilled`` -> ``oom_killed``; deleted, evicted or killed by a signal -> ``lost``.

Before its first launch the platform deletes the job's pods that a previous operator left (a
master on the same journal, agents in an old rendezvous), like the local platform's reaping.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from streamrover.operator.api import (
    LaunchError,
    MasterInfo,
    MasterLaunch,
    NodeLaunch,
    NodeState,
    NodeStatus,
    Platform,
    PlatformUnavailableError,
    Resources,
    UnknownNodeError,
)
from streamrover.operator.k8s_tls import K8sTls
from streamrover.tokens import worker_token

log = logging.getLogger(__name__)
GROUP, VERSION, KIND, PLURAL = "streamrover.io", "v1alpha1", "StreamTrainJob", "streamtrainjobs"
LABEL_JOB, LABEL_ROLE, LABEL_NODE = "streamrover.io/job", "streamrover.io/role", "streamrover.io/node"
TOKEN_KEY = "token"
WORKER_TOKEN_KEY = "worker-token"
DEFAULT_PORT = 7070
JOURNAL_MOUNT = "/var/lib/streamrover/journal"


@dataclass(frozen=True)
class K8sConfig:
    """How the operator lays a job out on the cluster (from its environment, see ``k8s_operator``)."""

    image: str = "streamrover:0.1.0"
    python: str = "python"  # the interpreter in the image
    master_bind: str = "0.0.0.0"
    master_host: str | None = None  # None: the Service's DNS name; "cluster-ip": its IP (a cluster without DNS)
    journal_host_dir: str | None = None  # None: a PersistentVolumeClaim per job
    journal_size: str = "1Gi"
    master_node_selector: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    launch_timeout: float = 180.0


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """An ownerReference to the custom resource ``body`` (the garbage collector deletes what it owns)."""
    meta = body["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def pod_name(job: str, node_id: str) -> str:
    """The name of node ``node_id``'s pod in job ``job`` (a valid Kubernetes name)."""
    return f"{job}-{node_id.replace('.', '-')}"


class K8sPlatform(Platform):
    """Pods in ``namespace``, owned by the ``StreamTrainJob`` ``owner`` (its full body)."""

    name = "k8s"

    def __init__(self, api_client: Any, namespace: str, owner: dict[str, Any], config: K8sConfig | None = None,
                 python: str | None = None) -> None:  # fmt: skip
        try:
            from kubernetes import client
        except ImportError as exc:
            raise PlatformUnavailableError("the k8s platform needs `pip install streamrover[k8s]`") from exc
        self.core = client.CoreV1Api(api_client)
        self.ns = namespace
        self.job = owner["metadata"]["name"]
        self.owner = owner_reference(owner)
        self.config = config or K8sConfig()
        self.python = python or self.config.python
        self._nodes: dict[str, NodeLaunch] = {}
        self._stopped: set[str] = set()
        self._master_gen = -1
        self._master_pod: str | None = None
        self._master_stopped = False
        self._abandoned = False
        self._resources: tuple[float, Resources] | None = None
        self._files: dict[str, str] = dict((owner.get("spec") or {}).get("files") or {})  # see k8s_files
        self.tls = K8sTls.of(owner)  # master.tls.secret: see k8s_tls
        self.reaped = self._reap()

    # -- objects ---------------------------------------------------------------------------
    def _meta(self, name: str, role: str, node: str = "") -> dict[str, Any]:
        labels = {LABEL_JOB: self.job, LABEL_ROLE: role, **({LABEL_NODE: node} if node else {})}
        return {"name": name, "namespace": self.ns, "labels": labels, "ownerReferences": [self.owner]}

    def _create(self, kind: str, body: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            getattr(self.core, f"create_namespaced_{kind}")(self.ns, body)
        except ApiException as exc:
            if exc.status != 409:  # already there (a relaunch, or a successor operator): keep it
                raise LaunchError(f"cannot create {kind} {body['metadata']['name']}: {exc.reason}: {exc.body}") from exc

    def _env(self, env: dict[str, str], role: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        for key, value in env.items():
            if key == "STREAMROVER_TOKEN":  # the master the admin token, workers the worker token (api.py, Roles)
                ref = {"name": f"{self.job}-token", "key": TOKEN_KEY if role == "master" else WORKER_TOKEN_KEY}
                out.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
            else:
                out.append({"name": key, "value": value})
        return [*out, {"name": "PYTHONUNBUFFERED", "value": "1"}]

    def _pod(self, name: str, role: str, node: str, command: list[str], env: dict[str, str],
             selector: dict[str, str], resources: dict[str, Any], volumes: list[dict[str, Any]] | None = None,
             mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
        container = {"name": role, "image": self.config.image, "command": command, "env": self._env(env, role),
                     "resources": resources, "volumeMounts": mounts or []}  # fmt: skip
        return {"apiVersion": "v1", "kind": "Pod", "metadata": self._meta(name, role, node),
                "spec": {"restartPolicy": "Never", "containers": [container], "volumes": volumes or [],
                         "nodeSelector": selector, "terminationGracePeriodSeconds": 60}}  # fmt: skip

    def _reap(self) -> list[str]:
        pods: list[Any] = self.core.list_namespaced_pod(self.ns, label_selector=f"{LABEL_JOB}={self.job}").items
        names: list[str] = [p.metadata.name for p in pods]
        for name in names:
            self._delete_pod(name, grace=5)
        for name in names:
            self._wait_gone(name, 120)
        if names:
            log.warning("deleted the pods a previous operator left for job %s: %s", self.job, names)
        return names

    def _read_pod(self, name: str) -> Any | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_pod(name, self.ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _delete_pod(self, name: str, grace: float) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=int(grace))
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _wait_gone(self, name: str, timeout: float) -> bool:
        give_up = time.monotonic() + timeout
        while self._read_pod(name) is not None:  # the node's kubelet finishes the deletion
            if time.monotonic() > give_up:
                return False
            time.sleep(0.2)
        return True

    # -- the master -------------------------------------------------------------------------
    def launch_master(self, launch: MasterLaunch) -> MasterInfo:
        if any(a.startswith("--tls") for a in launch.args) and self.tls is None:  # files here are not in its pod
            raise LaunchError("master.tls on Kubernetes names Secrets, not files: master.tls.secret (tls.crt, "
                              "tls.key, ca.crt: cert-manager's layout) and, for mutual TLS, "
                              "master.tls.client_secret")  # fmt: skip
        port = launch.port or DEFAULT_PORT
        self._create("secret", {"apiVersion": "v1", "kind": "Secret", "stringData": {TOKEN_KEY: launch.token,
                                WORKER_TOKEN_KEY: worker_token(launch.token)},
                                "metadata": self._meta(f"{self.job}-token", "token")})  # fmt: skip
        self._create("service", {"apiVersion": "v1", "kind": "Service",
                                 "metadata": self._meta(f"{self.job}-master", "master"),
                                 "spec": {"selector": {LABEL_JOB: self.job, LABEL_ROLE: "master"},
                                          "ports": [{"name": "grpc", "port": port, "targetPort": port}]}})  # fmt: skip
        if self.config.journal_host_dir:
            state_dir = f"{self.config.journal_host_dir.rstrip('/')}/{self.ns}/{self.job}"
            volume: dict[str, Any] = {"name": "journal", "hostPath": {"path": state_dir, "type": "DirectoryOrCreate"}}
        else:
            state_dir = JOURNAL_MOUNT
            claim = f"{self.job}-journal"
            self._create("persistent_volume_claim", {
                "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": self._meta(claim, "journal"),
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": self.config.journal_size}}},
            })  # fmt: skip
            volume = {"name": "journal", "persistentVolumeClaim": {"claimName": claim}}
        if self._master_pod:  # a relaunch: the old pod must be gone before a new master opens the journal
            self._delete_pod(self._master_pod, grace=5)
            self._wait_gone(self._master_pod, self.config.launch_timeout)
        self._master_gen += 1
        name = f"{self.job}-master-{self._master_gen}"
        command = [self.python, "-m", "streamrover.cli", "master", "--state-dir", state_dir, "--host",
                   self.config.master_bind, "--port", str(port), "--lease-ttl", str(launch.lease_ttl)]  # fmt: skip
        tls_volumes, tls_mounts = self.tls.volumes("master") if self.tls else ([], [])
        body = self._pod(name, "master", "", [*command, *launch.args], {"STREAMROVER_TOKEN": launch.token},
                         self.config.master_node_selector, {}, [volume, *tls_volumes],
                         [{"name": "journal", "mountPath": state_dir}, *tls_mounts])  # fmt: skip
        self._create("pod", body)
        self._master_pod, self._master_stopped = name, False
        host = self.config.master_host or f"{self.job}-master.{self.ns}.svc"
        if host == "cluster-ip":  # no cluster DNS: the Service's virtual IP (kube-proxy) reaches the master
            service: Any = self.core.read_namespaced_service(f"{self.job}-master", self.ns)
            host = str(service.spec.cluster_ip)
        give_up = time.monotonic() + self.config.launch_timeout
        while not _accepting(host, port):  # the master listens once its journal is open
            status = self.observe_master()
            if status.state.ended or time.monotonic() > give_up:
                raise LaunchError(f"the master pod {name} did not start listening on {host}:{port} "
                                  f"({status.state.value} {status.detail})")  # fmt: skip
            time.sleep(0.2)
        return MasterInfo(address=f"{host}:{port}", detail=f"pod {name}")

    def observe_master(self) -> NodeStatus:
        if self._master_pod is None:
            return NodeStatus("master", NodeState.PENDING)
        return pod_status("master", self._read_pod(self._master_pod), self._master_stopped)

    def stop_master(self, grace: float = 10.0) -> None:
        self._master_stopped = True
        if self._master_pod and not self._abandoned:
            self._delete_pod(self._master_pod, grace)

    # -- nodes ----------------------------------------------------------------------------
    def launch_node(self, launch: NodeLaunch) -> NodeStatus:
        resources: dict[str, Any] = {}
        if launch.memory is not None:
            resources = {"limits": {"memory": str(launch.memory)}, "requests": {"memory": str(launch.memory)}}
        if launch.cpu is not None:
            resources.setdefault("requests", {})["cpu"] = str(launch.cpu)
        command = [self.python if c == _local_python() else c for c in launch.command]
        volumes, mounts = self._shipped_files()
        if self.tls:  # the master's CA (not its key) and the job's client certificate
            tls_volumes, tls_mounts = self.tls.volumes("node")
            volumes, mounts = [*volumes, *tls_volumes], [*mounts, *tls_mounts]
        body = self._pod(pod_name(self.job, launch.node_id), "node", launch.node_id, command, launch.env,
                         self.config.node_selector, resources, volumes, mounts)  # fmt: skip
        self._create("pod", body)
        self._nodes[launch.node_id] = launch
        return self.observe(launch.node_id)

    def _shipped_files(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The ConfigMap of the files ``streamrover run`` shipped (made once), as a node pod's volume and mount."""
        from streamrover.operator.k8s_files import FILES_MOUNT, FILES_VOLUME, configmap_name

        if not self._files:
            return [], []
        name = configmap_name(self.job)
        self._create("config_map", {"apiVersion": "v1", "kind": "ConfigMap", "data": self._files,
                                    "metadata": self._meta(name, "files")})  # fmt: skip
        return ([{"name": FILES_VOLUME, "configMap": {"name": name}}],
                [{"name": FILES_VOLUME, "mountPath": FILES_MOUNT, "readOnly": True}])  # fmt: skip

    def observe(self, node_id: str) -> NodeStatus:
        if node_id not in self._nodes:
            raise UnknownNodeError(f"no node {node_id!r} was launched for job {self.job}")
        status = pod_status(node_id, self._read_pod(pod_name(self.job, node_id)), node_id in self._stopped)
        memory = self._nodes[node_id].memory
        return NodeStatus(status.node_id, status.state, status.exit_code, status.oom_kills, memory, None, status.detail)

    def stop_node(self, node_id: str, grace: float = 30.0) -> NodeStatus:
        if node_id not in self._nodes:
            raise UnknownNodeError(f"no node {node_id!r} was launched for job {self.job}")
        self._stopped.add(node_id)
        if not self._abandoned:
            name = pod_name(self.job, node_id)
            self._delete_pod(name, grace)  # SIGTERM: the agent leaves the rendezvous
            if not self._wait_gone(name, grace + 60):
                log.warning("pod %s still there %.0f s after its deletion", name, grace + 60)
        return NodeStatus(node_id, NodeState.STOPPED, memory=self._nodes[node_id].memory)

    def abandon(self) -> None:
        """Stop deleting anything: the custom resource is going (its pods are garbage-collected) or the operator
        exits (a successor takes the job over)."""
        self._abandoned = True

    def launcher_args(self) -> list[str]:
        return ["--local-addr", "$(POD_IP)"]  # expanded by the kubelet from the pod's env

    def resources(self) -> Resources:
        """The cluster's allocatable CPU and memory (listed at most every 30 s: the status asks every tick)."""
        from streamrover.operator.spec import parse_memory

        if self._resources is not None and time.monotonic() - self._resources[0] < 30:
            return self._resources[1]

        nodes: list[Any] = self.core.list_node().items
        have = [n.status.allocatable for n in nodes if n.status and n.status.allocatable]
        cpus = sum(_cpu(a.get("cpu", "0")) for a in have)
        memory = sum(parse_memory(a.get("memory", "0")) for a in have)
        found = Resources(cpus=cpus, memory=memory, memory_enforcement="pod-limit", detail={"nodes": len(nodes)})
        self._resources = (time.monotonic(), found)
        return found


def pod_status(node_id: str, pod: Any | None, stopped: bool) -> NodeStatus:
    """A node's state from its pod (``None``: the pod is gone)."""
    if pod is None:
        return NodeStatus(node_id, NodeState.STOPPED if stopped else NodeState.LOST, detail="pod deleted")
    phase = pod.status.phase if pod.status else None
    terminated = None
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        terminated = cs.state.terminated if cs.state else None
    code = terminated.exit_code if terminated else None
    if terminated is not None and terminated.reason == "OOMKilled":
        return NodeStatus(node_id, NodeState.OOM_KILLED, code, oom_kills=1, detail="OOMKilled")
    if stopped:
        return NodeStatus(node_id, NodeState.STOPPED, code)
    if pod.metadata.deletion_timestamp is not None:
        return NodeStatus(node_id, NodeState.LOST, code, detail="pod being deleted")
    if phase == "Succeeded":
        return NodeStatus(node_id, NodeState.SUCCEEDED, code or 0)
    if phase == "Failed":
        if pod.status.reason in ("Evicted", "NodeLost", "Shutdown") or (code is not None and code >= 128):
            return NodeStatus(node_id, NodeState.LOST, code, detail=pod.status.reason or f"exit code {code}")
        return NodeStatus(node_id, NodeState.FAILED, code, detail=f"exit code {code}")
    if phase == "Running":
        return NodeStatus(node_id, NodeState.RUNNING)
    return NodeStatus(node_id, NodeState.PENDING, detail=phase or "")


def _local_python() -> str:
    import sys

    return sys.executable


def _accepting(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def api_client(kubeconfig: str | None = None) -> Any:
    """A client for the cluster: in a pod its service account, else ``kubeconfig`` / ``$KUBECONFIG``."""
    import os

    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise PlatformUnavailableError("the k8s platform needs `pip install streamrover[k8s]`") from exc
    try:
        if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config()
            return client.ApiClient()
        return config.new_client_from_config(config_file=kubeconfig)
    except config.ConfigException as exc:
        raise PlatformUnavailableError(f"no Kubernetes cluster configured (--kubeconfig, $KUBECONFIG): {exc}") from None


def submit(spec: Any, namespace: str, api: Any, replicas: int | None = None,
           files: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Create the ``StreamTrainJob`` of a validated job spec (``streamrover run --platform k8s``), with the files it
    ships to the pods (:mod:`streamrover.operator.k8s_files`)."""
    import urllib3
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    body: dict[str, Any] = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                            "metadata": {"name": spec.name, "namespace": namespace},
                            "spec": {"job": spec.model_dump(mode="json", exclude_none=True)}}  # fmt: skip
    if replicas is not None:
        body["spec"]["replicas"] = replicas
    if files:
        body["spec"]["files"] = files
    try:
        out: Any = client.CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, body)
    except ApiException as exc:
        if exc.status == 409:
            raise LaunchError(f"a StreamTrainJob {spec.name!r} already exists in namespace {namespace!r} "
                              f"(`kubectl delete streamtrainjob {spec.name} -n {namespace}` first)") from None
        if exc.status == 404:
            raise LaunchError("the StreamTrainJob resource is not installed: `kubectl apply -f deploy/k8s/`") from None
        raise LaunchError(f"cannot create the StreamTrainJob {spec.name!r}: {exc.reason}: {exc.body}") from None
    except (OSError, urllib3.exceptions.HTTPError) as exc:  # the API server is not reachable
        raise PlatformUnavailableError(f"cannot reach the Kubernetes API server: {exc}") from None
    return dict(out)
