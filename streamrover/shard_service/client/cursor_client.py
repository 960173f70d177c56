"""A worker's acks as the cursor sees them: flushing queued acks, cuts, the cursor, restores.

:class:`CursorClient` is the part of :class:`~streamrover.shard_service.client.ShardClient`
that depends on this worker's queued acks being recorded first (``flush``, ``prepare_cut``,
``get_cursor``) or dropped (``restore_cursor``, ``restore_cut``); the worker's leasing,
reading and acking are in :mod:`.client`, the ack queue's semantics in :mod:`.client_acks`.
"""

from __future__ import annotations

from streamrover.cursor import DataCursor
from streamrover.shard_service import convert
from streamrover.shard_service.api import FailedPreconditionError
from streamrover.shard_service.client.admin import AdminClient
from streamrover.shard_service.client.client_acks import AckFailure, AckQueue
from streamrover.shard_service.client.lease_table import LeaseTable
from streamrover.shard_service.v1 import shard_service_pb2 as pb


class CursorClient(AdminClient):
    """Flush, cut, cursor and restore calls of a worker (its ack queue and lease table are made by the worker)."""

    _acks: AckQueue
    leases: LeaseTable
    _last_ack_answer: float
    run_id: str | None = None  # the master journal's run, as the last prepare_cut answered it

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every ack queued so far is answered; raise :class:`AckFailedError` for refused ones.

        Each refused ack is reported once: by this, by the next ack of its lease, or by
        :meth:`take_ack_failures`. Raises TimeoutError if acks are still unanswered after
        ``timeout`` seconds (each ack's RPC is retried for up to the client's ``timeout``).
        """
        self._acks.wait(timeout)
        self._acks.raise_failures()

    def take_ack_failures(self) -> list[AckFailure]:
        """Refused acks not yet reported, oldest first, without waiting or raising; they count as reported."""
        return self._acks.take_failures()

    @property
    def acks_pending(self) -> int:
        """Acks queued or in flight, not yet answered by the master."""
        return self._acks.pending

    @property
    def acks_in_flight(self) -> int:
        """Acks sent to the master and not yet answered (the rest of :attr:`acks_pending` is still queued)."""
        return self._acks.in_flight

    @property
    def last_ack_answered(self) -> float:
        """``time.monotonic()`` when the master last recorded an ack of this client (0.0 before the first)."""
        return self._last_ack_answer

    # ------------------------------------------------------------------- cursor
    def prepare_cut(self, step: int | None = None, *, persisting: bool = False) -> tuple[int, DataCursor]:
        """Take a cut of everything acked (with step <= ``step`` when given); returns (cut id, its cursor).

        Idempotent per ``step``: every rank of one checkpoint gets the same cut. ``persisting``: the
        checkpoint of this cut will be persisted, so the cut is kept until it commits, however long that takes.

        This client's queued acks are flushed first (:meth:`flush`), so the cut holds every ack
        this client made before the call; a refused one raises :class:`AckFailedError` and no
        cut is taken. Acks queued in *other* clients (other ranks) are theirs to flush first.
        """
        self.flush()
        request = pb.CutPrepareRequest(has_step=step is not None, step=step or 0, persisting=persisting)
        resp = self._call(self._stub.CutPrepare, request)
        self.run_id = resp.run_id or None
        return resp.cut_id, convert.cursor_from_pb(resp.cursor)

    def get_cursor(self) -> tuple[DataCursor, DataCursor]:
        """(committed cursor, committed plus acked cursor), after this client's queued acks (see :meth:`flush`)."""
        self.flush()
        resp = self._call(self._stub.GetCursor, pb.GetCursorRequest())
        return convert.cursor_from_pb(resp.committed), convert.cursor_from_pb(resp.acked)

    def restore_cursor(
        self,
        cursor: DataCursor,
        *,
        from_memory: bool = False,
        discard_committed: bool = False,
        snapshot_cut: int | None = None,
        snapshot_run: str | None = None,
    ) -> pb.RestoreResponse:
        """Reset the service to ``cursor``; every lease (this client's too) is revoked.

        ``from_memory``: the cursor is of a shared-memory snapshot that storage does not hold, so offsets
        committed upstream stay at the newest durable checkpoint's; a snapshot whose cut (``snapshot_cut``)
        or run (``snapshot_run``, the :attr:`run_id` its cut was prepared in) is not of the master's journal
        is refused: :class:`~streamrover.shard_service.client.refused.SnapshotRefusedError` (a
        ``FailedPreconditionError`` and the checkpoints' ``SnapshotRefusedError``, as is every
        ``FAILED_PRECONDITION`` answer to a ``from_memory`` restore). An empty ``cursor`` while the service
        has committed progress is refused (``FailedPreconditionError``) unless ``discard_committed``:
        that throws away every committed cut, and every record is read again.

        Acks still queued in this client are dropped, and unreported ack failures forgotten:
        they concern leases the restore revokes (an ack already in flight is answered first).
        """
        self._acks.discard()
        request = pb.RestoreRequest(
            cursor=convert.cursor_to_pb(cursor),
            from_memory=from_memory,
            discard_committed=discard_committed,
            snapshot_cut_id=snapshot_cut or 0,
            snapshot_run_id=snapshot_run or "",
        )
        try:
            resp = self._call(self._stub.Restore, request)
        except FailedPreconditionError as exc:
            if not from_memory:
                raise
            from streamrover.shard_service.client.refused import SnapshotRefusedError  # see its module docstring

            raise SnapshotRefusedError(str(exc)) from exc
        self.leases.forget_all()
        return resp

    def restore_cut(self, cut_id: int) -> pb.RestoreResponse:
        """Reset the service to a cut it remembers; queued acks are dropped as in :meth:`restore_cursor`."""
        self._acks.discard()
        resp = self._call(self._stub.Restore, pb.RestoreRequest(cut_id=cut_id))
        self.leases.forget_all()
        return resp
