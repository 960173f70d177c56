"""The master's compare-and-set key-value store (rendezvous state of elastic trainers)."""

from __future__ import annotations

import threading

from streamrover.shard_service import InvalidArgumentError, ShardClient
from streamrover.testing.procs import MasterProcess


def test_compare_and_set_is_atomic_and_durable(master: MasterProcess) -> None:
    client = ShardClient(master.address, token=master.token, heartbeat=False)
    assert client.kv_get("rdzv/job") is None
    assert client.kv_set("rdzv/job", b"\x00state-1", 0) == (True, b"\x00state-1", 1)
    ok, value, version = client.kv_set("rdzv/job", b"lost", 0)  # a stale writer sees the current state
    assert (ok, value, version) == (False, b"\x00state-1", 1)

    wins = []

    def contend(i: int) -> None:  # eight writers race from version 1: exactly one wins
        c = ShardClient(master.address, token=master.token, heartbeat=False)
        if c.kv_set("rdzv/job", f"writer-{i}".encode(), 1)[0]:
            wins.append(i)
        c.close()

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    master.kill()
    master.start()
    assert client.kv_get("rdzv/job") == (f"writer-{wins[0]}".encode(), 2)
    try:
        client.kv_set("", b"x", 0)
        raise AssertionError("an empty key must be refused")
    except InvalidArgumentError:
        pass
    client.close()
