"""The worker-side client of the shard service: lease, read, ack, heartbeat, cut.

``ShardClient`` is framework-neutral; trainers wrap it. A typical worker::

    with ShardClient("127.0.0.1:7070", token=token) as client:
        for shard in client.shards("clicks"):
            for batch in shard.batches():
                apply(batch.records)
                shard.ack(batch.end)

Calls survive a master restart: they wait for the channel to be ready and retry
``UNAVAILABLE`` with backoff for up to ``timeout`` seconds. Retried calls are
safe: acks are idempotent per attempt and lease requests carry a request id.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import pyarrow as pa

from streamrover.cursor import DataCursor
from streamrover.shard_service import convert
from streamrover.shard_service.api import (
    AckResult,
    AlreadyExistsError,
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseGrant,
    NotFoundError,
    ShardServiceError,
    StaleLeaseError,
    UnauthenticatedError,
    UnavailableError,
)
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc
from streamrover.sources.api import Partition, ReadBatch, Source, open_source

T = TypeVar("T")
_ERRORS: dict[grpc.StatusCode, type[ShardServiceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
DEFAULT_BATCH_SIZE = 4096


class LeaseLostError(StaleLeaseError):
    """This worker no longer holds the shard: stop applying its records."""


class LeasedShard:
    """A shard this worker holds: read its records from the source and ack positions."""

    def __init__(self, client: ShardClient, lease: LeaseGrant, source: Source) -> None:
        self.client = client
        self.lease = lease
        self.source = source
        self.position = lease.resume  # next position to read
        self.acked = lease.resume
        self.done = False
        self._dead_letters = 0  # read but not yet acked

    @property
    def shard_id(self) -> str:
        return self.lease.shard_id

    @property
    def revoked(self) -> bool:
        return (self.shard_id, self.lease.attempt) in self.client._revoked

    def batches(self, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[ReadBatch]:
        """The shard's records from its resume position to its end. Stops early if the lease is revoked."""
        part = Partition(self.lease.partition.id, self.lease.partition.start, self.lease.partition.end)
        for batch in self.source.read(part, self.position, self.lease.end, batch_size):
            if self.revoked:
                raise LeaseLostError(f"the lease on shard {self.shard_id!r} was revoked")
            self.position = batch.end
            self._dead_letters += batch.dead_letters
            yield batch
        if self.position < self.lease.end:  # no records in the tail (gaps): one empty batch so acking its end completes
            empty = pa.RecordBatch.from_pylist([], schema=self.source.schema())
            start, self.position = self.position, self.lease.end
            yield ReadBatch(empty, start, self.lease.end)

    def ack(self, position: int | None = None, step: int | None = None) -> AckResult:
        """Say the records before ``position`` (default: everything read so far) are applied."""
        pos = self.position if position is None else position
        more = self.client._lease_more.get(self.lease.dataset, 0) if pos == self.lease.end else 0
        try:
            result = self.client.ack(self.lease, pos, step, self._dead_letters, lease_more=more)
        except FailedPreconditionError as exc:
            raise LeaseLostError(str(exc)) from exc
        self._dead_letters = 0
        self.acked = max(self.acked, pos)
        self.done = result.shard_done
        if self.done:
            self.client._held.pop(self.shard_id, None)
        return result


class ShardClient:
    """A connection to the shard service, as a worker and as an administrator."""

    def __init__(
        self,
        address: str | None = None,
        token: str | None = None,
        name: str | None = None,
        *,
        timeout: float = 120.0,
        heartbeat: bool = True,
    ) -> None:
        self.address = address or os.environ.get("STREAMROVER_MASTER", "127.0.0.1:7070")
        self.token = token if token is not None else os.environ.get("STREAMROVER_TOKEN", "")
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 1)],
        )
        self._stub = pb_grpc.ShardServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {self.token}"),)
        self.worker_id = ""
        self.heartbeat_interval = 1.0
        self._want_heartbeat = heartbeat
        self._hb_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._request_id = 0
        self._sources: dict[str, Source] = {}
        self._held: dict[str, LeasedShard] = {}
        self._prefetched: dict[str, deque[LeasedShard]] = {}  # leases that came with acks, not yet yielded
        self._lease_more: dict[str, int] = {}
        self._revoked: set[tuple[str, int]] = set()  # (shard id, attempt): a shard id may be leased again

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        give_up = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            remaining = give_up - time.monotonic()
            try:
                return method(
                    request,
                    metadata=self._metadata,
                    wait_for_ready=True,
                    timeout=max(min(remaining, timeout or remaining), 0.01),
                )
            except grpc.RpcError as exc:
                code = exc.code()
                retry = code in _RETRYABLE or (code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is None)
                if retry and time.monotonic() + delay < give_up:
                    time.sleep(delay * (0.5 + random.random()))  # backoff between retries, not synchronisation
                    delay = min(delay * 2, 2.0)
                    continue
                error = _ERRORS.get(code, ShardServiceError)
                raise error(f"{exc.details()} [{code.name} from {self.address}]") from None

    def close(self) -> None:
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        for source in self._sources.values():
            source.close()
        self._channel.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.worker_id and exc[0] is None:
            self.leave()
        self.close()

    # ------------------------------------------------------------------ datasets
    def register_dataset(self, spec: DatasetSpec) -> pb.RegisterDatasetResponse:
        return self._call(self._stub.RegisterDataset, pb.RegisterDatasetRequest(spec=convert.spec_to_pb(spec)))

    def describe_dataset(self, name: str) -> pb.DatasetInfo:
        return self._call(self._stub.DescribeDataset, pb.DescribeDatasetRequest(name=name))

    def list_datasets(self) -> list[pb.DatasetInfo]:
        return list(self._call(self._stub.ListDatasets, pb.ListDatasetsRequest()).datasets)

    def status(self) -> pb.StatusResponse:
        return self._call(self._stub.Status, pb.StatusRequest())

    def _source(self, dataset: str) -> Source:
        source = self._sources.get(dataset)
        if source is None:
            spec = self.describe_dataset(dataset).spec
            source = open_source(spec.uri, spec.format, dict(spec.options))
            self._sources[dataset] = source
        return source

    # ------------------------------------------------------------------- worker
    def join(self) -> str:
        resp = self._call(self._stub.Join, pb.JoinRequest(name=self.name, worker_id=self.worker_id))
        self.worker_id = resp.worker_id
        self.heartbeat_interval = resp.heartbeat_interval_seconds
        if self._want_heartbeat and self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._heartbeats, name="shard-heartbeat", daemon=True)
            self._hb_thread.start()
        return self.worker_id

    def leave(self) -> int:
        self._stop.set()
        returned = self._call(self._stub.Leave, pb.LeaveRequest(worker_id=self.worker_id)).leases_returned
        self.worker_id = ""
        return returned

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            with self._lock:
                progress = [
                    pb.ShardProgress(shard_id=s.shard_id, attempt=s.lease.attempt, position=s.position)
                    for s in self._held.values()
                ]
            try:
                resp = self._call(
                    self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=self.worker_id, progress=progress)
                )
            except NotFoundError:  # declared dead (paused too long): every lease is gone; join afresh
                with self._lock:
                    self._revoked.update((s.shard_id, s.lease.attempt) for s in self._held.values())
                    self._held.clear()
                self.worker_id = ""
                self.join()
                continue
            except ShardServiceError:
                continue
            with self._lock:
                self._revoked.update((r.shard_id, r.attempt) for r in resp.revoked)

    def lease(self, dataset: str, max_shards: int = 1, wait: float = 5.0) -> tuple[int, list[LeasedShard]]:
        """Lease up to ``max_shards``; returns (pb.LeaseStatus value, leased shards)."""
        if not self.worker_id:
            self.join()
        with self._lock:
            self._request_id += 1
            request_id = self._request_id
        request = pb.LeaseRequest(
            worker_id=self.worker_id, dataset=dataset, max_shards=max_shards, request_id=request_id, wait_seconds=wait
        )
        try:
            resp = self._call(self._stub.LeaseShards, request)
        except NotFoundError as exc:
            if "worker" not in str(exc):
                raise
            self.worker_id = ""
            self.join()
            return pb.LEASE_STATUS_WAIT, []
        shards: list[LeasedShard] = []
        if resp.leases:
            self._adopt(dataset, resp.leases, shards)
        return resp.status, shards

    def shards(self, dataset: str, wait: float = 5.0, prefetch: int = 2) -> Iterator[LeasedShard]:
        """Yield leased shards until the dataset ends (batch) or forever (stream).

        Shards are leased ``prefetch`` at a time, so one lease round trip serves several
        shards; the ones waiting their turn are kept alive by heartbeats like the rest.
        """
        queue = self._prefetched.setdefault(dataset, deque())
        self._lease_more[dataset] = 1  # each finished shard's ack brings the next lease back with it
        try:
            while True:
                if not queue:
                    status, leased = self.lease(dataset, max(prefetch, 1), wait)
                    if status == pb.LEASE_STATUS_END:
                        return
                    queue.extend(leased)
                while queue:
                    yield queue.popleft()
        finally:
            self._lease_more.pop(dataset, None)

    def ack(
        self, lease: LeaseGrant, position: int, step: int | None = None, dead_letters: int = 0, lease_more: int = 0
    ) -> AckResult:
        """Ack ``position`` of ``lease``; with ``lease_more``, a finished shard brings up to that many new leases."""
        request = pb.AckRequest(
            lease_more=lease_more,
            dead_letters=dead_letters,
            worker_id=self.worker_id,
            shard_id=lease.shard_id,
            attempt=lease.attempt,
            position=position,
            has_step=step is not None,
            step=step or 0,
        )
        resp = self._call(self._stub.Ack, request)
        if resp.leases:
            self._adopt(lease.dataset, resp.leases, self._prefetched.setdefault(lease.dataset, deque()))
        return AckResult(shard_done=resp.shard_done, duplicate=resp.duplicate)

    def _adopt(self, dataset: str, leases: Any, into: deque[LeasedShard] | list[LeasedShard]) -> None:
        source = self._source(dataset)
        with self._lock:
            for msg in leases:
                shard = LeasedShard(self, convert.lease_from_pb(msg), source)
                self._held[shard.shard_id] = shard
                into.append(shard)

    # ------------------------------------------------------------------- cursor
    def prepare_cut(self, step: int | None = None) -> tuple[int, DataCursor]:
        request = pb.CutPrepareRequest(has_step=step is not None, step=step or 0)
        resp = self._call(self._stub.CutPrepare, request)
        return resp.cut_id, convert.cursor_from_pb(resp.cursor)

    def commit_cut(self, cut_id: int) -> DataCursor:
        resp = self._call(self._stub.CutCommit, pb.CutCommitRequest(cut_id=cut_id))
        return convert.cursor_from_pb(resp.committed)

    def get_cursor(self) -> tuple[DataCursor, DataCursor]:
        """(committed cursor, committed plus acked cursor)."""
        resp = self._call(self._stub.GetCursor, pb.GetCursorRequest())
        return convert.cursor_from_pb(resp.committed), convert.cursor_from_pb(resp.acked)

    def restore_cursor(self, cursor: DataCursor) -> pb.RestoreResponse:
        """Reset the service to ``cursor``; every lease (this client's too) is revoked."""
        resp = self._call(self._stub.Restore, pb.RestoreRequest(cursor=convert.cursor_to_pb(cursor)))
        self._forget_leases()
        return resp

    def restore_cut(self, cut_id: int) -> pb.RestoreResponse:
        resp = self._call(self._stub.Restore, pb.RestoreRequest(cut_id=cut_id))
        self._forget_leases()
        return resp

    def _forget_leases(self) -> None:
        """A restore revoked every lease: drop the held and prefetched ones so none is read again."""
        with self._lock:
            self._revoked.update((s.shard_id, s.lease.attempt) for s in self._held.values())
            self._held.clear()
            for queue in self._prefetched.values():
                queue.clear()

    # ---------------------------------------------------------------- key-value
    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version) of ``key``, or None when it was never set."""
        resp = self._call(self._stub.KvGet, pb.KvGetRequest(key=key))
        return (resp.value, resp.version) if resp.found else None

    def kv_set(self, key: str, value: bytes, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-set; returns (written, current value, current version)."""
        resp = self._call(self._stub.KvSet, pb.KvSetRequest(key=key, value=value, expected_version=expected_version))
        return resp.ok, resp.value, resp.version
