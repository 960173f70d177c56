"""The local platform's master launch with awkward tokens (real master processes, a few seconds)."""

from __future__ import annotations

from pathlib import Path

from streamrover.operator.api import MasterLaunch, NodeState
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
