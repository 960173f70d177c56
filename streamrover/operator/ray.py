"""The ``ray`` platform: the job master and each node as a Ray actor; Ray places them, streamrover supervises.

* Each actor (:class:`_Host`) runs a :class:`~streamrover.operator.local.LocalPlatform` on
  the Ray node it was placed on: the node is a ``dlrover-run`` process group there, in a
  memory cgroup where the machine allows it, exactly as locally. Its processes die with
  the actor (``PR_SET_PDEATHSIG``), so a Ray node that goes away takes its trainer node along.
* One placement group per job, ``trainer.nodes MAX`` bundles (``SPREAD``, ``trainer.cpu``
  CPUs each, default 1); a node is launched into a free bundle. When a Ray node dies, Ray
  reschedules its bundles onto the nodes left, and the relaunched node goes there.
* ``max_restarts=0``, ``max_task_retries=0``: Ray never restarts an actor or retries a call
  (which would run work twice); the supervisor decides what is relaunched.
* The master's actor runs on the head node (Ray's ``node:__internal_head__`` resource), the
  node a cluster keeps; its journal lives in ``master.state_dir`` there. If it dies anyway,
  the controller relaunches it (same port; on another node the address changes).
* Observing never blocks the supervisor: each ``observe`` collects the answer to the
  previous probe if it has arrived and sends the next (a Ray node that vanished without a
  word leaves calls pending until Ray declares its actors dead, tens of seconds).
* The cluster is Ray's usual ``RAY_ADDRESS`` (``ray start --head`` + ``ray start --address``,
  or ``ray.cluster_utils.Cluster`` in tests); with none set, the cluster ``ray start`` started on this
  machine, else a local Ray (:mod:`streamrover.operator.ray_connect`, with a deadline).

Calls into actors pass plain values (strings, numbers, lists, dicts).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
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
from streamrover.operator.local import LocalPlatform


class _Host:
    """Inside a Ray actor: a local platform on this Ray node, serving one master or one trainer node."""

    def __init__(self, workdir: str) -> None:
        self.local = LocalPlatform(workdir, die_with_parent=True, reap=False)  # hosts share the workdir

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def ray_node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def launch_master(self, launch: dict[str, Any]) -> dict[str, Any]:
        launch["state_dir"] = Path(launch["state_dir"])
        return asdict(self.local.launch_master(MasterLaunch(**launch)))

    def observe_master(self) -> dict[str, Any]:
        return _plain(self.local.observe_master())

    def stop_master(self, grace: float) -> None:
        self.local.stop_master(grace)

    def launch_node(self, launch: dict[str, Any]) -> dict[str, Any]:
        launch["workdir"] = Path(launch["workdir"]) if launch.get("workdir") else None
        return _plain(self.local.launch_node(NodeLaunch(**launch)))

    def observe(self, node_id: str) -> dict[str, Any]:
        return _plain(self.local.observe(node_id))

    def stop_node(self, node_id: str, grace: float) -> dict[str, Any]:
        return _plain(self.local.stop_node(node_id, grace))

    def close(self) -> None:
        self.local.close()


def _plain(status: NodeStatus) -> dict[str, Any]:
    out = asdict(status)
    out["state"] = status.state.value
    return out


def _status(doc: dict[str, Any]) -> NodeStatus:
    return NodeStatus(**{**doc, "state": NodeState(doc["state"])})


class RayPlatform(Platform):
    """Ray actors on the cluster at ``$RAY_ADDRESS`` (see the module docstring)."""

    name = "ray"

    def __init__(self, workdir: str | Path, address: str | None = None, max_nodes: int = 1, cpu: float | None = None,
                 namespace: str | None = None) -> None:  # fmt: skip
        try:
            import ray
        except ImportError as exc:
            raise PlatformUnavailableError("the ray platform needs Ray: pip install 'streamrover[ray]'") from exc
        self._ray = ray
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not ray.is_initialized():
            from streamrover.operator.ray_connect import connect

            connect(ray, address, namespace)  # RAY_ADDRESS, else the `ray start` cluster, else a local Ray
        self._actor_cls: Any = ray.remote(max_restarts=0, max_task_retries=0)(_Host)
        self._cpu = cpu or 1.0
        from ray.util.placement_group import placement_group

        self._pg = placement_group([{"CPU": self._cpu}] * max_nodes, strategy="SPREAD")
        self._bundles: dict[str, int] = {}  # node id -> bundle index
        self._hosts: dict[str, Any] = {}
        self._master: Any = None
        self._master_ip = "127.0.0.1"
        self._ended: dict[str, NodeStatus] = {}
        self._probes: dict[str, Any] = {}  # node id (or "master") -> the pending observe call
        self._seen: dict[str, NodeStatus] = {}  # the last answer

    # -- the master ------------------------------------------------------------------------
    def launch_master(self, launch: MasterLaunch, timeout: float = 120.0) -> MasterInfo:
        ray = self._ray
        if self._master is not None:
            ray.kill(self._master, no_restart=True)
        self._probes.pop("master", None)
        self._seen.pop("master", None)
        self._master = self._actor_cls.options(num_cpus=0, resources={"node:__internal_head__": 0.001}).remote(
            str(self.workdir)
        )
        doc = asdict(launch)
        doc["state_dir"] = str(launch.state_dir)
        try:
            info = ray.get(self._master.launch_master.remote(doc), timeout=timeout)
        except ray.exceptions.RayError as exc:
            raise LaunchError(f"the job master's Ray actor failed: {exc}") from exc
        self._master_ip = ray.get(self._master.node_ip.remote())
        address = info["address"]
        if launch.host in ("0.0.0.0", "::"):
            address = f"{self._master_ip}:{address.rsplit(':', 1)[1]}"
        return MasterInfo(address=address, pid=info.get("pid"), detail=f"ray node {self._master_ip}")

    def observe_master(self) -> NodeStatus:
        if self._master is None:
            return NodeStatus("master", NodeState.PENDING)
        return self._probe("master", self._master, "observe_master")

    def stop_master(self, grace: float = 10.0) -> None:
        if self._master is not None:
            try:
                self._ray.get(self._master.stop_master.remote(grace), timeout=grace + 30)
            except self._ray.exceptions.RayError:  # its actor is gone already: nothing to stop
                pass
            self._ray.kill(self._master, no_restart=True)
            self._master = None

    # -- nodes ---------------------------------------------------------------------------------
    def launch_node(self, launch: NodeLaunch, timeout: float = 300.0) -> NodeStatus:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        used = set(self._bundles.values())
        free = [i for i in range(len(self._pg.bundle_specs)) if i not in used]
        if not free:
            raise LaunchError(f"node {launch.node_id}: every bundle of the job's placement group is in use")
        ray = self._ray
        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=free[0])
        host = self._actor_cls.options(num_cpus=self._cpu, scheduling_strategy=strategy).remote(str(self.workdir))
        doc = asdict(launch)
        doc["workdir"] = str(launch.workdir) if launch.workdir else None
        try:
            status = _status(ray.get(host.launch_node.remote(doc), timeout=timeout))
        except ray.exceptions.RayError as exc:
            ray.kill(host, no_restart=True)
            raise LaunchError(f"node {launch.node_id}: its Ray actor failed to start it: {exc}") from exc
        self._hosts[launch.node_id], self._bundles[launch.node_id] = host, free[0]
        where = ray.get(host.ray_node.remote(), timeout=60)
        status = NodeStatus(status.node_id, status.state, status.exit_code, status.oom_kills, status.memory,
                            status.pid, f"ray node {where}")  # fmt: skip
        self._seen[launch.node_id] = status
        return status

    def _call(self, host: Any, node_id: str, method: str, *args: Any, timeout: float = 60.0) -> NodeStatus:
        ray = self._ray
        try:
            return _status(ray.get(getattr(host, method).remote(*args), timeout=timeout))
        except ray.exceptions.GetTimeoutError:
            return NodeStatus(node_id, NodeState.LOST, detail=f"its Ray actor did not answer within {timeout:.0f} s")
        except ray.exceptions.RayError as exc:
            return NodeStatus(node_id, NodeState.LOST, detail=f"its Ray actor died ({type(exc).__name__})")

    def _probe(self, key: str, host: Any, method: str, *args: Any) -> NodeStatus:
        """The answer to the last probe if it came (then the next is sent), else the last answer known."""
        ray = self._ray
        ref = self._probes.get(key)
        if ref is None:
            ref = self._probes[key] = getattr(host, method).remote(*args)
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return self._seen.get(key, NodeStatus(key, NodeState.RUNNING, detail="no answer from its actor yet"))
        del self._probes[key]
        try:
            status = _status(ray.get(ref))
        except ray.exceptions.ActorUnavailableError:
            # unreachable for now (its node is not answering): Ray says ActorDiedError once it knows it is gone
            return self._seen.get(key, NodeStatus(key, NodeState.RUNNING, detail="its actor is unreachable"))
        except ray.exceptions.RayError as exc:
            status = NodeStatus(key, NodeState.LOST, detail=f"its Ray actor died ({type(exc).__name__})")
        previous = self._seen.get(key)
        if previous is not None and previous.detail.startswith("ray node") and not status.detail:
            status = NodeStatus(status.node_id, status.state, status.exit_code, status.oom_kills, status.memory,
                                status.pid, previous.detail)  # fmt: skip
        self._seen[key] = status
        return status

    def observe(self, node_id: str) -> NodeStatus:
        if node_id in self._ended:
            return self._ended[node_id]
        if node_id not in self._hosts:
            raise UnknownNodeError(f"no node {node_id!r} was launched on this Ray platform")
        status = self._probe(node_id, self._hosts[node_id], "observe", node_id)
        if status.state.ended and status.state is not NodeState.OOM_KILLED:
            self._release(node_id, status)
        return status

    def stop_node(self, node_id: str, grace: float = 30.0) -> NodeStatus:
        if node_id in self._ended:
            return self._ended[node_id]
        if node_id not in self._hosts:
            raise UnknownNodeError(f"no node {node_id!r} was launched on this Ray platform")
        self._probes.pop(node_id, None)
        status = self._call(self._hosts[node_id], node_id, "stop_node", node_id, grace, timeout=grace + 30)
        self._release(node_id, status)
        return status

    def _release(self, node_id: str, status: NodeStatus) -> None:
        """The node ended: its actor goes, its bundle is free for a relaunch."""
        self._ended[node_id] = status
        host = self._hosts.pop(node_id, None)
        self._bundles.pop(node_id, None)
        if host is not None:
            self._ray.kill(host, no_restart=True)

    def resources(self) -> Resources:
        total = self._ray.cluster_resources()
        return Resources(cpus=float(total.get("CPU", 0)), memory=int(total.get("memory", 0)),
                         max_nodes=len(self._pg.bundle_specs), memory_enforcement="cgroup on each Ray node",
                         detail={"ray_nodes": len(self._ray.nodes())})  # fmt: skip

    def close(self) -> None:
        for node_id in list(self._hosts):
            self._release(node_id, NodeStatus(node_id, NodeState.STOPPED))
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)
