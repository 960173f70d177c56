"""The Kubernetes operator (kopf): one job controller per ``StreamTrainJob`` custom resource.

``python -m streamrover.operator.k8s_operator [--namespace NS | --all-namespaces]`` (the
Deployment in ``deploy/k8s/`` runs it). For each resource a kopf daemon runs the same
:class:`~streamrover.operator.controller.JobController` as ``streamrover run`` does locally, with
the :class:`~streamrover.operator.k8s.K8sPlatform`: it creates the master (pod + service + journal
volume) and the worker pods, relaunches failed pods, applies scale decisions (the autoscaler's, and
``spec.replicas`` through the ``scale`` subresource: ``kubectl scale streamtrainjob/NAME --replicas=N``),
stops the job gracefully on ``spec.stop: true`` (``streamrover stop NAME --platform k8s``) and writes
the status subresource (phase, nodes, replicas, lag, last checkpoint, recent decisions).

When the resource is deleted the daemon stops without deleting anything: the garbage collector
deletes the pods, service, secret and claim, which the resource owns. Configuration comes from the
environment: ``STREAMROVER_K8S_IMAGE``, ``STREAMROVER_K8S_PYTHON``, ``STREAMROVER_K8S_MASTER_HOST``,
``STREAMROVER_K8S_MASTER_BIND``, ``STREAMROVER_K8S_JOURNAL_HOST_DIR``, ``STREAMROVER_K8S_NODE_SELECTOR``
and ``STREAMROVER_K8S_MASTER_NODE_SELECTOR`` (``key=value,key=value``), ``STREAMROVER_K8S_WORKDIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf

from streamrover.operator.api import LaunchError
from streamrover.operator.controller import JobController
from streamrover.operator.jobs import JobDir
from streamrover.operator.k8s import GROUP, PLURAL, TOKEN_KEY, VERSION, WORKER_TOKEN_KEY, K8sConfig, K8sPlatform
from streamrover.operator.k8s_jobs import stop_requested
from streamrover.operator.spec import JobSpec, SpecError, parse_spec
from streamrover.tokens import new_token, worker_token

log = logging.getLogger(__name__)
STATUS_EVERY = 5.0  # seconds between unchanged status writes


def config_from_env(env: dict[str, str] | None = None) -> K8sConfig:
    """The operator's :class:`K8sConfig` from ``STREAMROVER_K8S_*`` variables."""
    env = dict(os.environ if env is None else env)

    def selector(key: str) -> dict[str, str]:
        pairs = [p.split("=", 1) for p in env.get(key, "").split(",") if p.strip()]
        return {k.strip(): v.strip() for k, v in pairs}

    return K8sConfig(image=env.get("STREAMROVER_K8S_IMAGE", K8sConfig.image),
                     python=env.get("STREAMROVER_K8S_PYTHON", K8sConfig.python),
                     master_bind=env.get("STREAMROVER_K8S_MASTER_BIND", K8sConfig.master_bind),
                     master_host=env.get("STREAMROVER_K8S_MASTER_HOST") or None,
                     journal_host_dir=env.get("STREAMROVER_K8S_JOURNAL_HOST_DIR") or None,
                     master_node_selector=selector("STREAMROVER_K8S_MASTER_NODE_SELECTOR"),
                     node_selector=selector("STREAMROVER_K8S_NODE_SELECTOR"))  # fmt: skip


@dataclass(frozen=True)
class ResourceJob(JobDir):
    """A job whose status lives in its custom resource's status subresource, its scale in ``spec.replicas``."""

    api: Any = None
    namespace: str = "default"
    body: Any = None  # kopf's live view of the resource
    state: dict[str, Any] = field(default_factory=dict)

    def write_status(self, doc: dict[str, Any]) -> None:
        """Patch the resource's status with ``doc`` (unchanged status is written at most every ``STATUS_EVERY``
        seconds).
        """
        status = resource_status(doc)
        key = json.dumps(status, sort_keys=True, default=str)
        now = time.monotonic()
        if key == self.state.get("written") and now - self.state.get("at", 0.0) < STATUS_EVERY:
            return
        status["updatedAt"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        patch_status(self.api, self.namespace, self.name, status)
        self.state.update(written=key, at=now)

    def take_scale_request(self) -> int | None:
        """The replicas the resource's spec asks for when they changed since last asked, else None."""
        wanted = (self.body.get("spec") or {}).get("replicas")
        if wanted is None or wanted == self.state.get("replicas"):
            return None
        self.state["replicas"] = wanted
        return int(wanted)


def resource_status(doc: dict[str, Any]) -> dict[str, Any]:
    """The status subresource from the controller's status document."""
    nodes = [{"node": n["node_id"], "state": n["state"], "memory": n.get("memory"), "detail": n.get("detail", ""),
              "oomKills": n.get("oom_kills", 0)} for n in doc.get("nodes", [])]  # fmt: skip
    out = {"phase": doc.get("phase", "starting"), "reason": doc.get("reason", ""), "nodes": nodes,
           "replicas": sum(1 for n in nodes if n["state"] in ("pending", "running")),
           "desiredNodes": doc.get("desired_nodes"), "master": doc.get("master", ""),
           "relaunches": doc.get("relaunches", 0), "runId": doc.get("run_id", ""),
           "events": [f"{e['kind']} {e['node']}: {e['message']}" for e in doc.get("events", [])[-10:]]}
    for key in ("lag", "lastCheckpoint", "recordsAcked"):  # fmt: skip
        if key in doc:
            out[key] = doc[key]
    return out


def patch_status(api: Any, namespace: str, name: str, status: dict[str, Any]) -> None:
    """Patch the status subresource of ``StreamTrainJob`` ``name`` in ``namespace``."""
    from kubernetes import client

    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status})


class K8sJobController(JobController):
    """The job controller with its token in a Secret and the master's lag and last checkpoint in the status."""

    def __init__(self, spec: JobSpec, job: ResourceJob, platform: K8sPlatform, token: str) -> None:
        super().__init__(spec, job, platform)
        self._token = token
        self._sample: dict[str, Any] = {}
        self._sampled = 0.0

    def resolve_token(self) -> str:
        return self._token

    def tls(self) -> tuple[tuple[str, ...], Any, dict[str, str] | None]:
        """``master.tls.secret``: the Secrets mounted into the pods, read into the job's directory for this
        controller (files named by the spec are not in the pods: refused)."""
        tls = self.spec.master.tls
        if tls is None:
            return (), None, None
        assert isinstance(self.platform, K8sPlatform)
        k8s_tls = self.platform.tls
        if k8s_tls is None:
            raise LaunchError("master.tls on Kubernetes names Secrets, not files: master.tls.secret (tls.crt, "
                              "tls.key, ca.crt, cert-manager's layout) and, for mutual TLS, "
                              "master.tls.client_secret")  # fmt: skip
        client_tls = k8s_tls.fetch(self.platform.core, self.platform.ns, self.job.path / "tls")
        return k8s_tls.master_args(), client_tls, k8s_tls.node_env()

    def _status(self) -> dict[str, Any]:
        doc = super()._status()
        if self.client is not None and time.monotonic() - self._sampled > 2.0:
            self._sampled = time.monotonic()
            try:
                st = self.client.status()
                streams = [d for d in st.datasets if d.kind == 2]
                self._sample = {"lag": sum(d.lag for d in streams), "lastCheckpoint": st.last_committed_cut,
                                "recordsAcked": sum(d.records_acked for d in st.datasets)}  # fmt: skip
            except Exception as exc:  # the master may be restarting: keep the last sample
                log.info("no status sample from the master: %s", exc)
        return {**doc, **self._sample}


def job_token(api: Any, namespace: str, name: str) -> str:
    """The job's token: from its Secret if a previous operator made one (a resumed job; the worker token added when
    that operator predates it), else a new one."""
    import base64

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api)
    try:
        secret: Any = core.read_namespaced_secret(f"{name}-token", namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return new_token()
    token = base64.b64decode(secret.data[TOKEN_KEY]).decode()
    if WORKER_TOKEN_KEY not in (secret.data or {}):  # made before the roles (issue 33): node pods need the key
        patch = {"stringData": {WORKER_TOKEN_KEY: worker_token(token)}}
        core.patch_namespaced_secret(f"{name}-token", namespace, patch)
        log.warning("added %s to Secret %s/%s-token (made by an older operator)", WORKER_TOKEN_KEY, namespace, name)
    return token


def run_job(api: Any, body: dict[str, Any], stopped: Any, config: K8sConfig, workdir: Path) -> None:
    """Run one resource's job until it ends or ``stopped`` is set (deletion, operator exit)."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if (body.get("status") or {}).get("phase") in ("succeeded", "failed", "stopped"):
        return  # a finished job is not run again when the operator restarts
    if stop_requested(body):
        patch_status(api, namespace, name, {"phase": "stopped", "reason": "stopped on request before it started"})
        return
    try:
        spec = parse_spec((body.get("spec") or {}).get("job"), f"{namespace}/{name} spec.job")
        if spec.name != name:
            raise SpecError(f"{namespace}/{name}", [("spec.job.name", f"{spec.name!r} is not the resource's name")])
        if not spec.checkpoint.url:
            raise SpecError(f"{namespace}/{name}", [("spec.job.checkpoint.url", "required on Kubernetes: a URL "
                                                     "every pod can reach")])  # fmt: skip
    except SpecError as exc:
        patch_status(api, namespace, name, {"phase": "failed", "reason": str(exc)})
        return
    if not body.get("status"):  # `streamrover run` waits for this (k8s_jobs.follow): an operator took the job
        patch_status(api, namespace, name, {"phase": "starting", "reason": "", "updatedAt": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())})  # fmt: skip
    job = ResourceJob(workdir / namespace / name, api=api, namespace=namespace, body=body)
    job.path.mkdir(parents=True, exist_ok=True)
    platform = K8sPlatform(api, namespace, body, config)
    controller = K8sJobController(spec, job, platform, job_token(api, namespace, name))
    errors: list[BaseException] = []

    def target() -> None:
        try:
            controller.run()
        except BaseException as exc:  # reported below, after the thread ends
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"job-{namespace}-{name}", daemon=True)
    thread.start()
    while thread.is_alive():
        if stopped.wait(0.5):  # deleted, or the operator exits: leave the pods to the garbage collector
            platform.abandon()
            controller.request_stop()
            thread.join()
            return
        if stop_requested(body):  # `streamrover stop`: the controller stops the nodes, then the master
            controller.request_stop()
    if errors:
        patch_status(api, namespace, name, {"phase": "failed", "reason": f"the controller failed: {errors[0]}"})
        raise kopf.PermanentError(str(errors[0]))


def _register(config: K8sConfig, workdir: Path) -> None:
    @kopf.on.startup()
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 60

    @kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=180)
    def _job(body: Any, stopped: Any, **_: Any) -> None:
        from kubernetes import config as kconfig

        api = kconfig.new_client_from_config() if "KUBERNETES_SERVICE_HOST" not in os.environ else _incluster()
        run_job(api, body, stopped, config, workdir)


def _incluster() -> Any:
    from kubernetes import client, config

    config.load_incluster_config()
    return client.ApiClient()


def main(argv: list[str] | None = None) -> None:
    """Run the operator until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m streamrover.operator.k8s_operator",
                                     description=(__doc__ or "").split("\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", action="append", help="watch only this namespace (repeatable)")
    where.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", default=None, help="serve liveness at this URL (http://0.0.0.0:8080/healthz)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workdir = Path(os.environ.get("STREAMROVER_K8S_WORKDIR") or tempfile.mkdtemp(prefix="streamrover-operator-"))
    _register(config_from_env(), workdir)
    namespaces = args.namespace or ([] if args.all_namespaces else [os.environ.get("POD_NAMESPACE", "default")])
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces, liveness_endpoint=args.liveness)


if __name__ == "__main__":
    main()
