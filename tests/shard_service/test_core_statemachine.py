"""Property-based test of the shard service core: the state machine of tests/shard_service/statemachine.py.

Its docstring lists what the model is and which invariants it checks after every rule.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from streamrover.cursor import PartitionKey
from tests.shard_service.statemachine import ShardServiceMachine

TestShardServiceMachine = ShardServiceMachine.TestCase
TestShardServiceMachine.settings = settings(
    max_examples=int(os.environ.get("SR_SM_EXAMPLES", "60")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine(tagged: bool = False) -> ShardServiceMachine:
    m = ShardServiceMachine()
    m.register(shuffle=False, size=5, tagged=tagged)
    return m


@pytest.mark.parametrize("n", [1])
def test_model_is_sensitive(n: int) -> None:
    """The invariant that guards double application fails when a record is applied twice."""
    m = _machine()
    m.applied[("d", 0, "a.parquet#rg0", 0)] = 2
    with pytest.raises(AssertionError):
        m.nothing_applied_twice()
    m.core.journal.close()


def test_step_cuts_are_checked_against_the_steps() -> None:
    """A cut of an earlier step that held a later step's records would fail the per-step check."""
    m = _machine(tagged=True)
    m.lease(w=0, n=1, ds="d")
    m.ack(i=0, frac=0.2)  # step 0
    m.step_ends(checkpoint=True)
    m.ack(i=0, frac=0.2)  # step 1
    m.cut_prepare()  # the records of step 0 only
    m.applied_step = dict.fromkeys(m.applied_step, 0)  # a model that forgot the steps: the same cut is wrong
    with pytest.raises(AssertionError, match="step 0"):
        m._take_cut(0)
    m.core.journal.close()


def test_a_memory_snapshot_restore_tells_the_broker_nothing_new() -> None:
    """Restoring a shared-memory snapshot (never persisted) must not move offsets committed upstream past storage."""
    m = _machine()
    m.stream_grows(p=0, n=20, force=True)  # t-0 holds [5, 29)
    m.lease(w=0, n=1, ds="s")
    m.ack(i=0, frac=1.0)  # the first shard of t-0, from its start
    m.cut_prepare()  # a memory snapshot: prepared, its persist never finished
    m.restore(i=0, memory=True, by_cursor=True)
    assert m.core.committed.get(PartitionKey("s", 0, "t-0")).size() > 0, "the memory snapshot holds records"
    m.upstream_commits_never_ahead_of_storage()
    m.master_restarts()  # before any cut committed the limit was not journalled: a restart took the snapshot for it
    m.upstream_commits_never_ahead_of_storage()
    m.core.journal.close()
