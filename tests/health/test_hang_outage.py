"""The hang watch does not take a master outage for a hang.

Workers whose calls to a master that is down retry make no progress, as hung ones do; with ``--hang-timeout``
(the job spec's default 30 s) the agent used to SIGKILL and restart every group of the job once an outage passed
the timeout, and again as long as it lasted. Now the agent's health heartbeats tell it when the master stopped
answering, and a worker's time without progress counts only from the master's return.
"""

from __future__ import annotations

from typing import Any

from streamrover.shard_service import ShardServiceError
from streamrover.trainers.torch.agent import HealthReporter, stuck_ranks


class _Master:
    """The KV calls a HealthReporter makes, answered or refused as the master is up or down."""

    def __init__(self) -> None:
        self.up = True
        self.version = 0

    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        if not self.up:
            raise ShardServiceError("the master is unreachable")
        return (b"{}", self.version) if self.version else None

    def kv_set(self, key: str, data: bytes, version: int) -> tuple[bool, Any, int]:
        if not self.up:
            raise ShardServiceError("the master is unreachable")
        self.version += 1
        return True, None, self.version


def test_a_master_outage_is_not_counted_as_a_hang() -> None:
    master, now = _Master(), [1000.0]
    health = HealthReporter(master, "run", "n0")  # type: ignore[arg-type]
    health.clock = lambda: now[0]
    health.start_heartbeat(5.0)  # grace: 2 intervals + 2 s = 12 s
    health.stop_heartbeat()  # the test beats by hand (_write(None) is one heartbeat)

    def beat(seconds: float) -> None:
        now[0] += seconds
        health._write(None)

    assert health.outage_age() is None, "no answer yet: nothing to tell"
    beat(0)
    assert health.outage_age() is None, "the master answers: no outage"
    hung = {0: 31.0, 1: 2.0}
    assert stuck_ranks(hung, 30.0, health.outage_age()) == {0: 31.0}, "a rank 31 s without progress is hung"

    master.up = False  # an outage of 60 s: the heartbeats fail
    for _ in range(12):
        beat(5)
        assert stuck_ranks({0: now[0] - 1000.0}, 30.0, health.outage_age()) == {}, f"{now[0] - 1000.0} s down"
    assert health.outage_age() == 0.0, "no answer for 60 s: the master is down"
    assert stuck_ranks({0: 60.0, 1: 60.0}, 30.0, health.outage_age()) == {}, "waiting for the master is no hang"

    master.up = True
    beat(5)  # the master answers again
    assert health.outage_age() == 0.0
    for _ in range(4):
        beat(5)
    assert health.outage_age() == 20.0
    assert stuck_ranks({0: 85.0, 1: 3.0}, 30.0, health.outage_age()) == {}, "20 s since the master came back"
    beat(5)
    beat(5)
    assert stuck_ranks({0: 95.0, 1: 3.0}, 30.0, health.outage_age()) == {}, "30 s since: not yet"
    now[0] += 1
    assert stuck_ranks({0: 96.0, 1: 3.0}, 30.0, health.outage_age()) == {0: 31.0}, "31 s after it: hung"


def test_without_heartbeats_the_hang_watch_counts_every_second() -> None:
    health = HealthReporter(None, "run", "n0")
    health.start_heartbeat(5.0)  # no client: no heartbeats, nothing known of the master
    assert health.outage_age() is None
    assert stuck_ranks({0: 31.0}, 30.0, health.outage_age()) == {0: 31.0}


class _CasMaster:
    """A KV store with compare-and-set versions that counts the reporter's calls."""

    def __init__(self) -> None:
        self.version, self.value, self.calls = 0, b"", []  # type: ignore[var-annotated]

    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        self.calls.append("get")
        return (self.value, self.version) if self.version else None

    def kv_set(self, key: str, data: bytes, version: int) -> tuple[bool, Any, int]:
        self.calls.append("set")
        if version != self.version:
            return False, self.value, self.version
        self.version, self.value = self.version + 1, data
        return True, data, self.version


def test_a_report_is_one_call_and_still_wins_over_another_writer() -> None:
    master = _CasMaster()
    health = HealthReporter(master, "run", "n0")  # type: ignore[arg-type]
    health.report("HEALTHY", 3, 0)
    health.report("FAILED", 3, 0)  # the agent's monitor reports this before the group restarts: one call
    assert master.calls == ["get", "set", "set"]
    master.version += 1  # another writer (an agent restarted under the same node id, say)
    health.report("HEALTHY", 2, 1)
    assert master.calls[3:] == ["set", "set"], "a stale version: the write fails once, then wins"
    assert b'"restarts_left": 2' in master.value
