"""The rendezvous's join gate (a group restart for joining nodes waits until every node the job wants is waiting;
pure), its membership watch (a node gone from the running round restarts the rest; pure) and the master store's
timeout."""

from __future__ import annotations

import pytest

from streamrover.testing.procs import MasterProcess
from streamrover.trainers.torch.rendezvous import JoinGate, MembershipWatch


def test_a_restart_waits_for_all_the_joining_nodes_the_job_wants_then_goes() -> None:
    """Scale-out 1 -> 3 under load: n1 reached the wait list seconds before n2, n0 restarted at once with n1
    (world 2), then again when n2 came (world 3): two full group restarts for one scale-out (seen: 10 s and
    29 s after the decision, the second round's workers 16 s later in a standby still importing)."""
    wanted: list[int | None] = [3]
    gate = JoinGate(lambda: wanted[0], grace=20.0)
    assert gate.admit(0, 1, now=100.0) == 0
    assert gate.admit(1, 1, now=101.0) == 0, "n1 waits: the job wants 3 nodes and 2 would form"
    assert gate.admit(1, 1, now=110.0) == 0
    assert gate.admit(2, 1, now=111.0) == 2, "n2 is waiting too: restart with both"
    assert gate.admit(0, 3, now=120.0) == 0
    assert gate.admit(1, 3, now=200.0) == 1, "a node waiting beyond what the job wants (a relaunch...): at once"


def test_a_node_that_never_comes_holds_the_restart_back_for_the_grace_only() -> None:
    wanted: list[int | None] = [3]
    gate = JoinGate(lambda: wanted[0], grace=20.0)
    assert gate.admit(1, 1, now=0.0) == 0
    assert gate.admit(1, 1, now=19.0) == 0
    assert gate.admit(1, 1, now=20.0) == 1, "n2's launch failed: go with n1 after the grace"
    wanted[0] = None  # no job controller says what it wants (a hand-started dlrover-run): nothing held back
    gate = JoinGate(lambda: wanted[0], grace=20.0)
    assert gate.admit(1, 1, now=0.0) == 1


def test_a_node_gone_from_the_running_round_is_seen_and_joins_are_not() -> None:
    watch = MembershipWatch()
    assert not watch.left(3, 1), "no workers started yet: nothing to restart"
    watch.started(4, 2)
    assert not watch.left(4, 2)
    assert not watch.left(4, 3), "a participant more is a join (the wait list's business), not a leave"
    assert watch.left(4, 1), "its keep-alive stopped: the rendezvous dropped it"
    watch.started(5, 1)
    assert not watch.left(5, 1)
    assert watch.left(6, 1), "a newer round began without this node's workers"


def test_the_store_waits_as_long_as_its_timeout_says(master: MasterProcess) -> None:
    """torchelastic's exit barrier sets the store's timeout (``store_timeout``) and waits without one: the master's
    store ignored it and waited its own 300 s (a node finished right after a scale-in sat 5 min in the barrier)."""
    from datetime import timedelta

    from streamrover.shard_service import ShardClient
    from streamrover.trainers.torch.rendezvous import MasterStore

    with ShardClient(master.address, token=master.token, heartbeat=False) as client:
        store = MasterStore(client, "rdzv/job/store")
        store.set_timeout(timedelta(seconds=1))
        assert store.timeout == timedelta(seconds=1)
        with pytest.raises(TimeoutError, match="within 1 s"):
            store.wait(["never"])
        with pytest.raises(TimeoutError, match="within 2 s"):
            store.wait(["never"], timedelta(seconds=2))  # an explicit timeout still wins
