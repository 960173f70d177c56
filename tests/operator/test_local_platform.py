"""The local platform: the master launch with awkward tokens, nodes in warm standby agents (real processes)."""

from __future__ import annotations

import sys
from pathlib import Path

from streamrover.operator.api import MasterLaunch, NodeLaunch, NodeState
from streamrover.operator.local import LocalPlatform
from streamrover.shard_service import ShardClient
from tests.helpers import wait_until


def test_a_token_starting_with_a_dash_starts_the_master(tmp_path: Path) -> None:
    """Generated tokens are URL-safe base64: one in 64 starts with '-' (a CI run hit it)."""
    platform = LocalPlatform(tmp_path / "logs")
    token = "-starts-with-a-dash_0123456789"
    try:
        info = platform.launch_master(MasterLaunch("job", tmp_path / "master", token))
        assert platform.observe_master().state is NodeState.RUNNING
        with ShardClient(info.address, token=token, heartbeat=False, timeout=30) as client:
            assert client.list_datasets() == []
        assert token not in (Path(f"/proc/{info.pid}/cmdline").read_bytes().decode()), "the token is not in ps"
    finally:
        platform.stop_master()
        platform.close()
    assert platform.observe_master().state is NodeState.STOPPED


def test_what_the_master_prints_after_its_address_goes_to_its_log_and_it_stays_up(tmp_path: Path) -> None:
    """The platform read the address line and closed the master's stdout: the dashboard line printed after
    it was lost, or (a race, seen under load) killed the master with BrokenPipeError."""
    platform = LocalPlatform(tmp_path / "logs")
    try:
        info = platform.launch_master(MasterLaunch("job", tmp_path / "master", "t0ken"))
        log = tmp_path / "logs" / "master.log"
        wait_until(lambda: "dashboard: http://" in log.read_text(errors="replace"), 60, "the dashboard line in the log")
        assert platform.observe_master().state is NodeState.RUNNING, log.read_text()
        with ShardClient(info.address, token="t0ken", heartbeat=False, timeout=30) as client:
            assert client.list_datasets() == []
    finally:
        platform.stop_master()
        platform.close()


def test_a_node_starts_in_a_warm_standby_agent_with_its_environment_directory_and_log(tmp_path: Path) -> None:
    """A scale-out's new agents paid ``import torch`` first (~17 s of a 57 s pause at load 10-20): the platform
    keeps standby agents with it imported; a node starts in one as its own process, with its log, working
    directory and environment, and its exit code observed. An environment torch may read (not streamrover's
    own) gets a fresh process: torch read its environment when the standby imported it. A standby agent also
    warms its workers' standbys (``standby_workers``): the node's own worker pool adopts them, spawning nothing
    (a scale-out's new workers had started in standbys still importing torch, and the group waited for them); a
    worker started in one without its own stdout writes to the node's log, as a worker Popen started would."""
    worker = tmp_path / "worker.py"
    worker.write_text("print('the worker wrote', flush=True)\n")
    script = tmp_path / "node.py"
    script.write_text(
        "import os, sys\nimport psutil\nfrom streamrover.trainers.standby import StandbyPool\n"
        "before = {c.pid for c in psutil.Process().children()}\npool = StandbyPool(1)\npool.fill()\n"
        "adopted = bool(before) and {c.pid for c in psutil.Process().children()} == before\n"
        "print(os.getpid(), os.getcwd(), os.environ.get('STREAMROVER_X'), 'torch' in sys.modules, adopted,\n"
        "      flush=True)\n"
        f"if adopted:\n    pool.start([sys.executable, '-u', {str(worker)!r}], dict(os.environ), None, None).wait()\n"
        "os._exit(3)\n")  # fmt: skip
    platform = LocalPlatform(tmp_path / "logs", cgroups=False, standby_agents=1, standby_workers=1)
    logs = tmp_path / "logs"

    def ended(node_id: str) -> bool:
        return platform.observe(node_id).state.ended

    try:
        platform.launch_node(NodeLaunch("job", "n0", [sys.executable, str(script)], {"STREAMROVER_X": "0"}))
        wait_until(lambda: ended("n0"), 60, "n0 (started afresh: no standby was warm yet) to exit")
        assert (logs / "node-n0.log").read_text().split()[2:] == ["0", "False", "False"]
        wait_until(lambda: platform.warm_agents() == 1, 120, "a warm standby agent")
        first = platform.launch_node(NodeLaunch("job", "n1", [sys.executable, str(script)], {"STREAMROVER_X": "1"},
                                                workdir=tmp_path / "n1"))  # fmt: skip
        wait_until(lambda: ended("n1"), 240, "n1 and its worker to exit")
        lines = (tmp_path / "n1" / "node-n1.log").read_text().splitlines()
        pid, cwd, x, warm, adopted = lines[0].split()
        assert (int(pid), cwd, x, warm) == (first.pid, str(tmp_path / "n1"), "1", "True")
        assert adopted == "True", "the node's worker pool spawned a fresh standby: none was warmed for it"
        assert "the worker wrote" in lines[1:], "the worker's output is not in the node's log"
        status = platform.observe("n1")
        assert (status.state, status.exit_code) == (NodeState.FAILED, 3)
        wait_until(lambda: platform.warm_agents() == 1, 120, "the pool refilled")
        platform.launch_node(NodeLaunch("job", "n2", [sys.executable, str(script)], {"OMP_NUM_THREADS": "1"}))
        wait_until(lambda: ended("n2"), 60, "n2 to exit")
        assert (logs / "node-n2.log").read_text().split()[3] == "False", "not in the standby: a fresh process"
    finally:
        platform.close()
