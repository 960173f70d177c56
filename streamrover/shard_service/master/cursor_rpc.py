"""The cursor RPCs: take and commit cuts (checkpoints), read the cursor, restore to a cursor or a cut.

The servicer binds :func:`cut_prepare`, :func:`cut_commit`, :func:`get_cursor` and :func:`restore` as its
methods (``server.py``); the cuts are the core's ``ShardCore.cut_book`` (:mod:`.cuts`). A commit or a restore
hands the new committed positions to the stream pollers (:func:`commit_upstream`), which commit them upstream.
A worker token may restore only to a cursor this master issued (``api.py``, **Roles**).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamrover.shard_service import convert
from streamrover.shard_service.api import InvalidArgumentError, PermissionDeniedError, Role
from streamrover.shard_service.master.auth import role_in
from streamrover.shard_service.master.compaction import expand
from streamrover.shard_service.master.staged_rpc import delete_trained_files
from streamrover.shard_service.v1 import shard_service_pb2 as pb

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.master.server import ShardServicer


def cut_prepare(self: ShardServicer, request: pb.CutPrepareRequest, context: Any) -> pb.CutPrepareResponse:
    """RPC: :meth:`ShardCore.cut_prepare`."""
    with self.cond:
        cut = self.core.cut_prepare(request.step if request.has_step else None, persisting=request.persisting)
        return pb.CutPrepareResponse(
            cut_id=cut.id, cursor=convert.cursor_to_pb(cut.cursor), run_id=self.core.cut_book.run_id
        )


def cut_commit(self: ShardServicer, request: pb.CutCommitRequest, context: Any) -> pb.CutCommitResponse:
    """RPC: :meth:`ShardCore.cut_commit`; upstream commits and staged retention follow."""
    with self.cond:
        committed = self.core.cut_commit(request.cut_id)
        commit_upstream(self)
        trained = self.core.staged.trained_staged_files()
    delete_trained_files(trained)  # I/O outside the lock
    return pb.CutCommitResponse(committed=convert.cursor_to_pb(committed))


def get_cursor(self: ShardServicer, request: pb.GetCursorRequest, context: Any) -> pb.GetCursorResponse:
    """RPC: the committed cursor and the acked cursor."""
    with self.cond:
        return pb.GetCursorResponse(
            committed=convert.cursor_to_pb(self.core.committed),
            acked=convert.cursor_to_pb(self.core.acked_cursor()),
        )


def restore(self: ShardServicer, request: pb.RestoreRequest, context: Any) -> pb.RestoreResponse:
    """RPC: :meth:`ShardCore.restore` to a cursor or a remembered cut."""
    which = request.WhichOneof("target")
    if which is None:
        raise InvalidArgumentError("restore: give a cut_id or a cursor")
    worker = role_in(context, self.tokens) is not Role.ADMIN
    if worker and (which != "cursor" or request.discard_committed):
        raise PermissionDeniedError(
            "Restore to a cut or discarding committed progress: the worker role may not; it needs the admin token"
        )
    snapshot_cut, snapshot_run = request.snapshot_cut_id or None, request.snapshot_run_id or None
    with self.cond:
        if which == "cursor" and request.from_memory:  # before the role's check: a precise answer to a stale snapshot
            self.core.cut_book.check_snapshot(convert.cursor_from_pb(request.cursor), snapshot_cut, snapshot_run)
        asked = expand(convert.cursor_from_pb(request.cursor), self.core.datasets) if worker else None
        if asked is not None and not self.core.cut_book.issued(asked):
            raise PermissionDeniedError(
                "Restore to a cursor this master did not issue (not the committed or durable cursor, nor a "
                "cut it remembers): the worker role may not; it needs the admin token"
            )
        if which == "cursor":
            revoked, requeued = self.core.restore(
                cursor=convert.cursor_from_pb(request.cursor),
                discard_committed=request.discard_committed,
                from_memory=request.from_memory,
                snapshot_cut=snapshot_cut,
                snapshot_run=snapshot_run,
            )
        else:
            revoked, requeued = self.core.restore(
                cut_id=request.cut_id, discard_committed=request.discard_committed
            )
        commit_upstream(self)
        self.cond.notify_all()
        return pb.RestoreResponse(leases_revoked=revoked, records_requeued=requeued)


def commit_upstream(self: ShardServicer) -> None:
    """Hand the committed positions of stream datasets to their pollers (called with the lock held)."""
    for name, poller in self.pollers.items():
        poller.commit_later(self.core.committed_positions(self.core.datasets[name]))
