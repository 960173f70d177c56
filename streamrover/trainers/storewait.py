"""A restarted worker's process-group store client waits for its server instead of backing off for up to a second.

``init_process_group`` (``env://``, what torchrun and ``dlrover-run`` workers use, the agent's store not shared)
makes rank 0 host the group's ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT`` and every other rank connect to it.
Whichever rank reaches that call first is a matter of scheduling. A client that arrives before the server
listens is refused, and c10d retries after an exponential back-off with jitter: measured here, 0.28-0.73 s
before its next try (six tries of a client 20-50 ms ahead of its server). The whole group waits that long in
``init_process_group`` (seen as 0.47-1.5 s "process group" in ``bench torch_recovery`` under load, against
0.008 s when rank 0 came first; torchrun's side shows it in most runs).

:func:`install` wraps ``torch.distributed.rendezvous._create_c10d_store`` (the function ``env://`` and
``tcp://`` call) so that a client rank first waits for the server's port to accept a connection, probing it
every 1-10 ms, then lets c10d connect (at once). The probe is a plain TCP connect closed straight away: the
store's server accepts it and drops it when it closes, as it does for any client that goes away. The
standby interpreters (:mod:`~streamrover.trainers.standby`) install it before they run a worker's script;
a rank that hosts the store, or whose store the agent serves, is not changed.
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)
PROBE_FIRST = 0.001  # seconds between the first probes of a port not listening yet
PROBE_MAX = 0.01  # ... growing to this


def wait_listening(host: str, port: int, timeout: float) -> bool:
    """Wait until ``host:port`` accepts a TCP connection (True), or up to ``timeout`` seconds (False).

    Only a refused connection is waited out; any other error (an unknown host, no route) returns False at
    once, for the caller's own connect to report."""
    give_up = time.monotonic() + timeout
    delay = PROBE_FIRST
    while True:
        left = give_up - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(left, 0.001)).close()
            return True
        except ConnectionRefusedError:
            if delay == PROBE_FIRST:
                log.debug("the store at %s:%d is not listening yet: waiting for it", host, port)
            if left <= 0:
                return False
        except OSError:
            return False
        time.sleep(min(delay, max(left, 0.0)))  # polling a port another process is about to open
        delay = min(delay * 2, PROBE_MAX)


def install() -> bool:
    """Make process-group store clients wait for their server (see the module docstring); idempotent.

    Returns whether it is installed; False when ``torch.distributed`` is not imported in this process (the
    standby of a worker that does not use torch: nothing to change) or has no such function."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    if rendezvous is None or original is None:
        return False
    if getattr(original, "_streamrover_waits", False):
        return True
    agent_serves = getattr(rendezvous, "_agent_store_serves", None)

    @functools.wraps(original)
    def create_c10d_store(hostname: str, port: int, rank: int, world_size: int, timeout: timedelta | float,
                          *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if rank != 0 and not (agent_serves is not None and agent_serves(hostname, port)):
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            wait_listening(hostname, port, seconds)
        return original(hostname, port, rank, world_size, timeout, *args, **kwargs)

    create_c10d_store._streamrover_waits = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = create_c10d_store  # type: ignore[attr-defined]
    return True
