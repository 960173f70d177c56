"""A test-only node agent: a stand-in for the kubelet, which this machine cannot run (no container runtime).

``python -m tests.operator.k8s.node_agent --kubeconfig K --node NAME --workdir DIR [--label k=v]``

It registers the Node ``NAME`` (not kwok's: kwok leaves it alone) and keeps it Ready, then does
for the pods the scheduler binds to it what a kubelet would, through the real API server:

* runs the pod's (single) container ``command`` + ``args`` as a local process in its own session,
  with the container's ``env`` (``value``, ``secretKeyRef`` read from the API, ``fieldRef`` of
  ``status.podIP`` / ``metadata.name`` / ``metadata.namespace``) and ``$(VAR)`` expanded in the
  command as the kubelet does, on top of this agent's own environment (the "image");
* reports ``Running`` (pod IP 127.0.0.1), then ``Succeeded``/``Failed`` with the container's exit
  code (128 + signal for a signal, like a container runtime);
* enforces the container's **memory limit** as the kubelet does: the container runs in a memory
  cgroup of that limit (:mod:`streamrover.operator.cgroups`, the local platform's; where none can be
  made, resident memory of its processes is watched instead), so the kernel's OOM killer acts; on
  an OOM kill the whole container is killed (the kubelet's ``memory.oom.group`` on cgroup v2, its
  default since 1.32) and reported ``terminated: {reason: OOMKilled, exitCode: 137}``;
* on deletion sends SIGTERM to the process group, SIGKILL after the grace period, then
  finishes the deletion (``grace_period_seconds=0``) as the kubelet does.

Volumes are not mounted: a hostPath volume works only when it is mounted at its own path (the
operator's ``STREAMROVER_K8S_JOURNAL_HOST_DIR`` layout does that). A ConfigMap or Secret volume is written
into the pod's own directory (``<workdir>/<namespace>/<pod>/mounts/<mountPath>``, read from the API as a
kubelet would, a Secret's ``items`` only when it lists them), and the command's arguments and environment
values under its ``mountPath`` are pointed there: no mount
namespace here, but a pod sees only what its spec and the API give it, not the submitter's files.
Pods are polled every 0.2 s (a stand-in: simpler than a watch, and the API server does not mind).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from streamrover.operator.cgroups import NodeCgroup, memory_cgroups
from streamrover.operator.spec import parse_memory
from tests.operator.k8s.cluster import fake_node


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    uid: str
    container: str
    started: str
    kill_at: float | None = None
    reported: bool = False
    memory: int | None = None  # the container's memory limit
    cgroup: NodeCgroup | None = None  # None with a limit: watched (no writable memory cgroup here)
    oom_killed: bool = False

    def over_limit(self) -> bool:
        """Whether the OOM killer acted in the container's cgroup (or, watched, its processes exceed the limit)."""
        if self.memory is None:
            return False
        if self.cgroup is not None:
            return self.cgroup.oom_kills() > 0
        try:
            procs = [psutil.Process(self.proc.pid)]
            return sum(p.memory_info().rss for p in procs + procs[0].children(recursive=True)) > self.memory
        except psutil.Error:
            return False

    def kill_all(self) -> None:
        """SIGKILL every process of the container (its cgroup's, and its process group)."""
        if self.cgroup is not None:
            self.cgroup.kill_all()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class NodeAgent:
    """Runs the pods bound to one node (see the module docstring)."""

    def __init__(self, core: Any, node: str, workdir: Path, labels: dict[str, str]) -> None:
        self.core, self.node, self.workdir, self.labels = core, node, workdir, labels
        self.running: dict[tuple[str, str], _Running] = {}
        self.done: set[str] = set()  # uids whose process ended and was reported
        self._beat = 0.0
        self._cgroups = memory_cgroups()
        self._stale: list[NodeCgroup] = []  # cgroups to remove once their processes are gone

    def register(self) -> None:
        body = fake_node(self.node, {"streamrover.io/agent": "true", **self.labels}, kwok=False)
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self.heartbeat()

    def heartbeat(self) -> None:
        now = _now()
        ready = {"type": "Ready", "status": "True", "reason": "NodeAgentReady", "message": "test node agent",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
        status = {"conditions": [ready], "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                  "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110"},
                  "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110"}}  # fmt: skip
        self.core.patch_node_status(self.node, {"status": status})
        self._beat = time.monotonic()

    def step(self) -> None:
        if time.monotonic() - self._beat > 10:
            self.heartbeat()
        self._stale = [cg for cg in self._stale if not cg.remove()]
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}").items
        seen = set()
        for pod in pods:
            key = (pod.metadata.namespace, pod.metadata.name)
            seen.add(key)
            run = self.running.get(key)
            if pod.metadata.deletion_timestamp is not None:
                self._deleting(pod, run)
            elif run is None and pod.metadata.uid not in self.done and pod.status.phase in (None, "Pending"):
                self._start(pod)
            elif run is not None and not run.reported:
                if not run.oom_killed and run.over_limit():
                    run.oom_killed = True
                    run.kill_all()
                if run.proc.poll() is not None:
                    self._ended(pod, run)
        for key in [k for k in self.running if k not in seen]:  # force-deleted: nothing left to report to
            self._forget(self.running.pop(key))

    def _env(self, pod: Any, container: Any) -> dict[str, str]:
        env = dict(os.environ)
        field_values = {"status.podIP": "127.0.0.1", "metadata.name": pod.metadata.name,
                        "metadata.namespace": pod.metadata.namespace, "spec.nodeName": self.node}  # fmt: skip
        for var in container.env or []:
            if var.value_from is None:
                env[var.name] = var.value or ""
            elif var.value_from.secret_key_ref is not None:
                ref = var.value_from.secret_key_ref
                secret = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace)
                env[var.name] = base64.b64decode(secret.data[ref.key]).decode()
            elif var.value_from.field_ref is not None:
                env[var.name] = field_values[var.value_from.field_ref.field_path]
        return env

    def _start(self, pod: Any) -> None:
        container = pod.spec.containers[0]
        env = self._env(pod, container)
        expand = lambda s: re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), s)  # noqa: E731
        argv = [expand(a) for a in [*(container.command or []), *(container.args or [])]]
        for volume in pod.spec.volumes or []:  # no mounts: a hostPath is used at its own path (see the docstring)
            if volume.host_path is not None and volume.host_path.type == "DirectoryOrCreate":
                Path(volume.host_path.path).mkdir(parents=True, exist_ok=True)
        cwd = self.workdir / pod.metadata.namespace / pod.metadata.name
        cwd.mkdir(parents=True, exist_ok=True)
        argv = self._mount_config_maps(pod, container, cwd, argv, env)
        limits = (container.resources.limits if container.resources else None) or {}
        memory = parse_memory(limits["memory"]) if "memory" in limits else None
        cgroup = None
        if memory is not None and self._cgroups is not None:
            cgroup = self._cgroups.create(f"node-agent.{pod.metadata.namespace}.{pod.metadata.name}", memory)
            # the shell joins the cgroup, then execs the container's command: nothing of it starts outside
            join = f"echo $$ > {cgroup.path / 'cgroup.procs'} && exec \"$@\""
            argv = ["/bin/sh", "-c", join, "container", *argv]
        with open(cwd / "container.log", "ab") as log:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        started = _now()
        self.running[(pod.metadata.namespace, pod.metadata.name)] = _Running(
            proc, pod.metadata.uid, container.name, started, memory=memory, cgroup=cgroup)
        state = {"running": {"startedAt": started}}
        self._report(pod, "Running", container.name, state, ready=True, started=started)

    def _mount_config_maps(self, pod: Any, container: Any, cwd: Path, argv: list[str],
                           env: dict[str, str]) -> list[str]:  # fmt: skip
        """Write the container's ConfigMap and Secret volumes under ``cwd/mounts`` (a Secret's ``items`` only, when
        given); ``argv`` and ``env`` values with their paths pointed there."""
        volumes = {v.name: v for v in pod.spec.volumes or [] if v.config_map is not None or v.secret is not None}
        ns = pod.metadata.namespace
        for mount in container.volume_mounts or []:
            volume = volumes.get(mount.name)
            if volume is None:
                continue
            target = cwd / "mounts" / mount.mount_path.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            if volume.config_map is not None:
                data = {k: v.encode() for k, v in (self.core.read_namespaced_config_map(
                    volume.config_map.name, ns).data or {}).items()}  # fmt: skip
                items = volume.config_map.items
            else:
                secret = self.core.read_namespaced_secret(volume.secret.secret_name, ns)
                data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
                items = volume.secret.items
            paths = {i.key: i.path for i in items} if items else {k: k for k in data}
            for key, path in paths.items():
                (target / path).write_bytes(data[key])
                if volume.secret is not None:
                    (target / path).chmod(0o600)
            prefix = mount.mount_path.rstrip("/") + "/"
            argv = [str(target / a[len(prefix):]) if a.startswith(prefix) else a for a in argv]
            for name, value in env.items():
                if value.startswith(prefix):
                    env[name] = str(target / value[len(prefix):])
        return argv

    def _ended(self, pod: Any, run: _Running) -> None:
        code = run.proc.returncode
        exit_code = 128 - code if code < 0 else code  # a signal, as a container runtime reports it
        reason = "Completed" if code == 0 else "Error"
        if run.oom_killed or run.over_limit():  # the kernel's OOM kill may have ended it before a step saw it
            run.kill_all()
            reason, exit_code, code = "OOMKilled", 137, -9
        state = {"terminated": {"exitCode": exit_code, "reason": reason, "startedAt": run.started,
                                "finishedAt": _now(), **({"signal": -code} if code < 0 else {})}}  # fmt: skip
        self._report(pod, "Succeeded" if code == 0 else "Failed", run.container, state, ready=False,
                     started=run.started)  # fmt: skip
        run.reported = True
        self.done.add(run.uid)
        self._remove_cgroup(run)

    def _report(self, pod: Any, phase: str, container: str, state: dict[str, Any], ready: bool, started: str) -> None:
        status = {"phase": phase, "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "hostIP": "127.0.0.1",
                  "startTime": started,
                  "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": _now()}],
                  "containerStatuses": [{"name": container, "ready": ready, "restartCount": 0, "image": "local",
                                         "imageID": "", "state": state}]}  # fmt: skip
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": status})
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _deleting(self, pod: Any, run: _Running | None) -> None:
        key = (pod.metadata.namespace, pod.metadata.name)
        if run is not None and run.proc.poll() is None:
            if run.kill_at is None:
                self._kill(run.proc, signal.SIGTERM)
                run.kill_at = time.monotonic() + (pod.metadata.deletion_grace_period_seconds or 0)
            if time.monotonic() < run.kill_at:
                return
            self._kill(run.proc, signal.SIGKILL)
            run.proc.wait()
        if run is not None:
            self._forget(run)  # what is left of its processes
        self.running.pop(key, None)
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _forget(self, run: _Running) -> None:
        run.kill_all()
        run.proc.wait()
        self._remove_cgroup(run)

    def _remove_cgroup(self, run: _Running) -> None:
        if run.cgroup is not None and not run.cgroup.remove():  # EBUSY: processes still exiting: a later step
            self._stale.append(run.cgroup)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        for run in self.running.values():
            self._forget(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--label", action="append", default=[], help="key=value")
    args = parser.parse_args()
    core = client.CoreV1Api(config.new_client_from_config(config_file=args.kubeconfig))
    agent = NodeAgent(core, args.node, args.workdir, dict(x.split("=", 1) for x in args.label))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    agent.register()
    print(f"node agent for {args.node} ready", flush=True)
    try:
        while not stop:
            agent.step()
            time.sleep(0.2)  # the polling period of this stand-in
    finally:
        agent.close()


if __name__ == "__main__":
    main()
