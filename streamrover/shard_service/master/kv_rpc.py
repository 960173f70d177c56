"""The key-value RPCs: coordination state (the torch rendezvous) in the master's journal.

The servicer binds :func:`kv_get`, :func:`kv_set` and :func:`kv_delete_range` as its methods (``server.py``);
the store is the core's part ``ShardCore.kv`` (:mod:`.kv`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamrover.shard_service.v1 import shard_service_pb2 as pb

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.master.server import ShardServicer


def kv_get(self: ShardServicer, request: pb.KvGetRequest, context: Any) -> pb.KvGetResponse:
    """RPC: the value and version of ``request.key`` (``found`` False when absent)."""
    with self.cond:
        found = self.core.kv.get(request.key)
    if found is None:
        return pb.KvGetResponse(found=False)
    return pb.KvGetResponse(found=True, value=found[0], version=found[1])


def kv_set(self: ShardServicer, request: pb.KvSetRequest, context: Any) -> pb.KvSetResponse:
    """RPC: compare-and-set (or, with ``delete``, compare-and-delete) ``request.key`` at ``expected_version``."""
    with self.cond:
        if request.delete:
            ok, value, version = self.core.kv.delete(request.key, request.expected_version, request.writer)
        else:
            ok, value, version = self.core.kv.set(request.key, request.value, request.expected_version, request.writer)
    return pb.KvSetResponse(ok=ok, value=value, version=version)


def kv_delete_range(self: ShardServicer, request: pb.KvDeleteRangeRequest, context: Any) -> pb.KvDeleteRangeResponse:
    """RPC: remove every key in ``[key, range_end)`` whatever its version; answers how many were removed."""
    with self.cond:
        return pb.KvDeleteRangeResponse(deleted=self.core.kv.delete_range(request.key, request.range_end))
