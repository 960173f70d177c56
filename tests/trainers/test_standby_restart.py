"""What a warm standby does for a fast group restart beyond its imports.

* A worker started in it that reaches the group's store before its server waits for it (storewait.py). c10d's own
  client, refused, retries after 0.3-1.5 s (its back-off); the group's restart then waited that long in
  ``init_process_group``. The test makes rank 1 arrive first for sure: the port is held bound but not listening
  until rank 1 has been refused, and only then does the "rank 0" server start on it.
* Once warm, its anonymous memory is in 2 MB pages (hugepages.py): the worker it becomes dies faster.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

from streamrover.trainers.standby import StandbyPool
from streamrover.trainers.storewait import wait_listening
from tests.helpers import wait_until

RANK1 = textwrap.dedent(
    """
    import logging, os, sys, time
    from datetime import timedelta
    from torch.distributed.rendezvous import rendezvous
    logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
    store, rank, world = next(rendezvous("env://", rank=1, world_size=2, timeout=timedelta(seconds=60)))
    store.set("from1", "hello")
    print("rank 1 got", store.get("from0").decode(), flush=True)
    """
)

# c10d's trace line when its connect is refused (TORCH_CPP_LOG_LEVEL=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL; both read
# when torch is imported, in the standby)
C10D_REFUSED = "is not yet listening"
LOUD = {"TORCH_CPP_LOG_LEVEL": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
OURS_REFUSED = "not listening yet: waiting for it"


def _reserved_port() -> socket.socket:
    """A socket bound to a free port and not listening: connecting to the port is refused until it is closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def _anonymous_kb(pid: int) -> tuple[int, int]:
    """(anonymous, of which in huge pages) kB of a process."""
    rows = dict(line.split()[:2] for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return int(rows["Anonymous:"]), int(rows["AnonHugePages:"])


def test_a_warm_standby_is_in_huge_pages_and_its_rank_waits_for_the_store_server(tmp_path: Path) -> None:
    from torch.distributed import TCPStore

    held = _reserved_port()
    port = held.getsockname()[1]
    script = tmp_path / "rank1.py"
    script.write_text(RANK1)
    pool = StandbyPool(1, interpreter=sys.executable, flags=("-u",), warm=("torch.distributed",),
                       env={**os.environ, **LOUD})  # fmt: skip
    try:
        pool.fill()
        wait_until(lambda: pool.ready() == 1, 120, "a warm standby")
        anonymous, huge = _anonymous_kb(pool._standbys[0].proc.pid)
        # ~0.25 GB after importing torch.distributed, ~80% of it collapsed here; without the collapse (and without
        # the malloc tunable, not set here) none unless the machine's THP mode is "always"
        assert huge >= anonymous // 2, f"{huge} of {anonymous} kB of the standby's anonymous memory in huge pages"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **LOUD}
        err = tmp_path / "err.txt"
        with open(tmp_path / "out.txt", "w") as out, open(err, "w") as errf:
            proc = pool.start([sys.executable, "-u", str(script)], env, out, errf)
        assert proc is not None
        refused = (OURS_REFUSED, C10D_REFUSED)
        wait_until(lambda: proc.poll() is not None or any(r in err.read_text() for r in refused), 120,
                   "rank 1 to be refused by the port nobody listens on yet")  # fmt: skip
        assert proc.poll() is None, err.read_text()
        held.close()
        server = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60), wait_for_workers=False)
        server.set("from0", "world")
        assert server.get("from1") == b"hello"
        assert proc.wait(timeout=60) == 0, err.read_text()
    finally:
        held.close()
        pool.close()
    assert (tmp_path / "out.txt").read_text() == "rank 1 got world\n"
    log = err.read_text()
    assert C10D_REFUSED not in log, "c10d's client was refused: it backs off 0.3-1.5 s before it tries again"
    assert OURS_REFUSED in log


def test_waiting_gives_up_on_a_port_that_never_listens_or_a_host_that_does_not_resolve() -> None:
    held = _reserved_port()
    try:
        assert not wait_listening("127.0.0.1", held.getsockname()[1], 0.05)
    finally:
        held.close()
    assert not wait_listening("no-such-host.invalid", 1, 60.0)  # at once: only refusals are waited out
