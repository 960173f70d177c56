"""A worker's membership in the job: it joins, heartbeats keep its leases alive, it leaves.

:class:`MemberClient` is the part of :class:`~streamrover.shard_service.client.ShardClient` that makes
the worker known to the master (``Join``: the worker id, the heartbeat interval), keeps it so from a
thread (``Heartbeat`` every interval, with each held lease's progress; the answer names the leases
revoked since; a worker declared dead joins afresh, its leases gone) and ends it (``Leave``: queued acks
first, then every lease held goes back). Leasing and acking are in :mod:`.shard_client`.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

from streamrover.shard_service.api import NotFoundError, ShardServiceError
from streamrover.shard_service.client.cursor_client import CursorClient
from streamrover.shard_service.v1 import shard_service_pb2 as pb


class MemberClient(CursorClient):
    """Join, heartbeats and leave of a worker (its state is made by the worker's ``__init__``)."""

    worker_id: str
    heartbeat_interval: float
    _want_heartbeat: bool
    _hb_thread: threading.Thread | None
    _stop: threading.Event
    _left: bool

    def join(self) -> str:
        """Join the job as a worker (:meth:`ShardService.join`); returns the worker id and starts the heartbeats.

        The id is chosen here, before the call, so that a join retried after its answer was lost is the same
        worker's (a master-chosen id would make a second worker, and leave the first to expire).
        """
        worker_id = self.worker_id or f"w-{uuid.uuid4().hex[:12]}"
        resp = self._call(self._stub.Join, pb.JoinRequest(name=self.name, worker_id=worker_id))
        self.worker_id = resp.worker_id
        self._left = False
        self.heartbeat_interval = resp.heartbeat_interval_seconds
        if self._want_heartbeat and self._transport.streaming:  # the stream opens now, not in the first lease's time
            beat = pb.HeartbeatRequest(worker_id=self.worker_id)
            with contextlib.suppress(ShardServiceError):  # it opens again with the next call
                self._transport.worker_call("heartbeat", self._stub.Heartbeat, beat)
        if self._want_heartbeat and self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._heartbeats, name="shard-heartbeat", daemon=True)
            self._hb_thread.start()
        return self.worker_id

    def leave(self) -> int:
        """Leave the job: queued acks are sent first, then every lease still held goes back.

        Returns how many leases went back. Raises :class:`AckFailedError` afterwards (the
        worker has left) if acks sent in the background were refused and not yet reported.
        """
        self._stop.set()
        self._left = True
        self._acks.wait()
        request = pb.LeaveRequest(worker_id=self.worker_id)
        returned = self._transport.call(self._stub.Leave, request, gone=pb.LeaveResponse()).leases_returned
        self.worker_id = ""
        self._acks.raise_failures()
        return returned

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            progress = [pb.ShardProgress(shard_id=i, attempt=a, position=p) for i, a, p in self.leases.progress()]
            request = pb.HeartbeatRequest(worker_id=self.worker_id, progress=progress)
            try:
                resp = self._transport.worker_call("heartbeat", self._stub.Heartbeat, request)
            except NotFoundError:  # declared dead (paused too long): every lease is gone; join afresh
                if self._stop.is_set():  # ...unless this client left meanwhile (leave() or close())
                    return
                self.leases.revoke_held()
                self.worker_id = ""
                self.join()
                continue
            except ShardServiceError:
                continue
            self.leases.revoke((r.shard_id, r.attempt) for r in resp.revoked)
