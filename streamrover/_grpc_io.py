"""gRPC's I/O for streamrover's processes: its poll-based I/O, chosen before grpc is first imported.

grpcio 1.8x does a client's and a server's socket I/O on its EventEngine threads, which adds a
thread hand-off to each message of a stream. A worker's leases and acks are messages on one
long-lived stream (:mod:`streamrover.shard_service.client.transport`), so that hand-off is paid per shard.
Measured on the 2-core machines (session 8, ``python -m benchmarks shard_service --only rtt``, both
sides and the bare echo peers under the same setting): one client's lease-then-ack messages
1,350-1,530/s with the EventEngine I/O, 1,695-1,875/s with the poll-based one, while the bare
unary echo stayed at ~2,000 RPC/s either way.

gRPC reads ``GRPC_EXPERIMENTS`` once, when it is first imported, for the whole process, and child
processes inherit it. So importing ``streamrover`` sets it (when grpc is not imported yet and the
variable is not set already: a user's own setting wins); ``STREAMROVER_GRPC_EVENT_ENGINE=1``
keeps gRPC's defaults. Standard library only, like ``import streamrover``.

Not in processes that run Ray: Ray's own gRPC core reads the same variable and does not know these
experiments (``Unknown experiment: event_engine_for_all_other_endpoints`` in every Ray process). A Ray
worker imports grpc before streamrover, so nothing is set there; a driver calls :func:`leave_grpc_to_ray`
before ``ray.init`` so the Ray processes it starts and its core worker go without it (streamrover processes
started later, the master and the nodes, set it again when they import streamrover).
"""

from __future__ import annotations

import os
import sys

POLL_IO = "-event_engine_client,-event_engine_for_all_other_endpoints"


def choose_poll_io() -> bool:
    """Set ``GRPC_EXPERIMENTS`` to :data:`POLL_IO` if it can still take effect and nobody chose; True if set."""
    if "grpc" in sys.modules or "ray" in sys.modules or "GRPC_EXPERIMENTS" in os.environ:
        return False
    if os.environ.get("STREAMROVER_GRPC_EVENT_ENGINE") == "1":
        return False
    os.environ["GRPC_EXPERIMENTS"] = POLL_IO
    return True


def leave_grpc_to_ray() -> None:
    """Unset ``GRPC_EXPERIMENTS`` if it is streamrover's choice (before ``ray.init``: see the module docstring)."""
    if os.environ.get("GRPC_EXPERIMENTS") == POLL_IO:
        del os.environ["GRPC_EXPERIMENTS"]


__all__ = ["POLL_IO", "choose_poll_io", "leave_grpc_to_ray"]
