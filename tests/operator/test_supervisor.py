"""The supervisor's decisions against a scripted platform (pure: no processes; the real ones are in test_local_job)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from streamrover.operator.api import (
    LaunchError,
    MasterInfo,
    MasterLaunch,
    NodeLaunch,
    NodeState,
    NodeStatus,
    Platform,
    Resources,
)
from streamrover.operator.spec import parse_spec
from streamrover.operator.supervisor import JobPhase, Supervisor


class ScriptedPlatform(Platform):
    """Nodes whose state the test sets; launches recorded; ``refuse`` makes the next launches fail."""

    name = "scripted"

    def __init__(self) -> None:
        self.states: dict[str, NodeStatus] = {}
        self.launches: list[NodeLaunch] = []
        self.stops: list[str] = []
        self.refuse = 0

    def launch_master(self, launch: MasterLaunch) -> MasterInfo:
        return MasterInfo("127.0.0.1:1")

    def observe_master(self) -> NodeStatus:
        return NodeStatus("master", NodeState.RUNNING)

    def stop_master(self, grace: float = 10.0) -> None:
        pass

    def launch_node(self, launch: NodeLaunch) -> NodeStatus:
        if self.refuse:
            self.refuse -= 1
            raise LaunchError("no room")
        self.launches.append(launch)
        self.states[launch.node_id] = NodeStatus(launch.node_id, NodeState.RUNNING, memory=launch.memory)
        return self.states[launch.node_id]

    def stop_node(self, node_id: str, grace: float = 30.0) -> NodeStatus:
        self.stops.append(node_id)
        old = self.states[node_id]
        if not old.state.ended:
            self.states[node_id] = NodeStatus(node_id, NodeState.STOPPED, -15, old.oom_kills)
        return self.states[node_id]

    def observe(self, node_id: str) -> NodeStatus:
        return self.states[node_id]

    def resources(self) -> Resources:
        return Resources(cpus=2, memory=1 << 34)

    def set(self, node_id: str, state: NodeState, code: int | None = None, oom: int = 0) -> None:
        self.states[node_id] = NodeStatus(node_id, state, code, oom)


def _supervisor(**overrides: Any) -> tuple[Supervisor, ScriptedPlatform]:
    data: dict[str, Any] = {
        "name": "job",
        "datasets": [{"name": "d", "uri": "/data"}],
        "trainer": {"script": "/t.py", "nodes": "1:3", "memory": "1Gi"},
        "restart": {"per_job": 3, "oom": {"factor": 2, "max_memory": "2Gi"}},
    }
    data.update(overrides)
    platform = ScriptedPlatform()
    sup = Supervisor(parse_spec(data), platform, run_id="r", master_address="127.0.0.1:1", token="t",
                     ckpt_url="/ckpt")  # fmt: skip
    sup.start()
    return sup, platform


def test_oom_doubles_memory_then_fails_at_the_ceiling() -> None:
    sup, platform = _supervisor()
    platform.set("n0", NodeState.OOM_KILLED, None, oom=1)  # a worker was killed; the agent lives on
    sup.tick()
    assert platform.stops == ["n0"], "the OOM-killed node is stopped before its relaunch"
    assert [(launch.node_id, launch.memory) for launch in platform.launches] == [("n0", 2**30), ("n0.1", 2**31)]
    platform.set("n0.1", NodeState.OOM_KILLED, -9, oom=1)
    sup.tick()
    assert sup.phase is JobPhase.FAILED
    assert sup.reason == "node n0.1 was OOM-killed at the memory ceiling 2Gi (restart.oom.max_memory)"
    assert len(platform.launches) == 2


def test_a_launch_the_platform_refuses_counts_against_the_budget() -> None:
    sup, platform = _supervisor()
    platform.refuse = 5
    platform.set("n0", NodeState.LOST, -9)
    for _ in range(5):
        sup.tick()
    assert sup.phase is JobPhase.FAILED and "restart.per_job" in sup.reason, sup.reason
    assert "could not launch: no room" in sup.reason
    assert sup.relaunches == 3


def test_scale_bounds_and_scale_in_stops_the_highest_slots() -> None:
    sup, platform = _supervisor()
    with pytest.raises(ValueError, match="outside this job's bounds 1:3"):
        sup.scale(4)
    sup.scale(3)
    sup.tick()
    assert [launch.node_id for launch in platform.launches] == ["n0", "n1", "n2"]
    sup.scale(1)
    sup.tick()
    assert sorted(platform.stops) == ["n1", "n2"] and sup.status()["desired_nodes"] == 1
    assert [n["node_id"] for n in sup.status()["nodes"]] == ["n0"]
    sup.scale(2)
    sup.tick()
    assert platform.launches[-1].node_id == "n1.1", "a slot's new node never reuses an id"


def test_a_node_that_failed_after_another_succeeded_is_not_relaunched() -> None:
    sup, platform = _supervisor(trainer={"script": "/t.py", "nodes": "2:2"})
    platform.set("n0", NodeState.SUCCEEDED, 0)
    platform.set("n1", NodeState.FAILED, 1)
    sup.tick()
    assert sup.phase is JobPhase.SUCCEEDED and len(platform.launches) == 2


def test_a_silent_node_counts_lost_and_is_relaunched() -> None:
    now = [1000.0]
    sup, platform = _supervisor(restart={"heartbeat_timeout": 30})
    sup.clock = lambda: now[0]
    sup.health = lambda run_id, node_id: {"heartbeat_at": 1000.0, "restarts_left": 3}
    sup.nodes["n0"].launched_at = 1000.0
    now[0] = 1020.0
    sup.tick()
    assert len(platform.launches) == 1, "20 s of silence is within the timeout"
    now[0] = 1031.0
    sup.tick()
    assert platform.stops == ["n0"] and platform.launches[-1].node_id == "n0.1"
    assert any(e.kind == "heartbeat" for e in sup.events)


def test_a_scale_in_by_two_nodes_stops_them_at_once() -> None:
    """Each node that leaves makes the others re-rendezvous: stopped one after the other (each stop waits for its
    agent to leave), the second leaves while the survivors re-form with it, a second pause; signalled together,
    one. The scripted stop waits until the other leaving node was asked too (a barrier: one at a time breaks it)."""
    sup, platform = _supervisor()
    sup.scale(3)
    sup.tick()
    barrier = threading.Barrier(2, timeout=10)
    stop = platform.stop_node

    def stop_together(node_id: str, grace: float = 30.0) -> NodeStatus:
        barrier.wait()
        return stop(node_id, grace)

    platform.stop_node = stop_together  # type: ignore[method-assign]
    sup.scale(1)
    sup.tick()
    assert sorted(platform.stops) == ["n1", "n2"] and not barrier.broken
    assert [n["node_id"] for n in sup.status()["nodes"]] == ["n0"]
    assert [e.node for e in sup.events if e.kind == "scale-in"] == ["n2", "n1"]
