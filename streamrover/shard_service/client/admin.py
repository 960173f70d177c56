"""The administrator's calls of the shard service: datasets, status, committing cuts, the key-value store.

:class:`AdminClient` needs no worker identity: a CLI or an operator uses it alone;
:class:`~streamrover.shard_service.client.ShardClient` (the worker) is one too.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from streamrover.cursor import DataCursor
from streamrover.shard_service import convert
from streamrover.shard_service.api import DatasetSpec
from streamrover.shard_service.client.tls import ClientTls
from streamrover.shard_service.client.transport import Transport
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc

T = TypeVar("T")


def _writer() -> str:
    """A new write id (see KvSetRequest.writer)."""
    return uuid.uuid4().hex


class AdminClient:
    """A connection to the shard service for its administrative calls (each retried through a master restart)."""

    def __init__(
        self,
        address: str | None = None,
        token: str | None = None,
        name: str | None = None,
        *,
        timeout: float = 120.0,
        session: bool = False,
        tls: ClientTls | bool | None = True,
    ) -> None:
        """Connect to the master at ``address`` (default ``$STREAMROVER_MASTER``) with ``token``.

        ``name`` (default host:pid) names this client where the master reports it; ``session``: a
        worker's per-shard calls go over one session stream (see :mod:`.transport`). ``tls``: True (default) =
        from the environment (``$STREAMROVER_TLS_CA``..., :mod:`.tls`), a :class:`ClientTls`, or None = plaintext.
        """
        self.address = address or os.environ.get("STREAMROVER_MASTER", "127.0.0.1:7070")
        self.token = token if token is not None else os.environ.get("STREAMROVER_TOKEN", "")
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.timeout = timeout
        self._transport = Transport(self.address, self.token, timeout, session=session, tls=tls)

    # ------------------------------------------------------------------ plumbing
    @property
    def _stub(self) -> pb_grpc.ShardServiceStub:
        return self._transport.stub

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        return self._transport.call(method, request, timeout)

    def close(self) -> None:
        """Close the connection."""
        self._transport.close()

    # ------------------------------------------------------------------ datasets
    def register_dataset(self, spec: DatasetSpec) -> pb.RegisterDatasetResponse:
        """Register a dataset (idempotent for the same spec); the response says whether it was created."""
        return self._call(self._stub.RegisterDataset, pb.RegisterDatasetRequest(spec=convert.spec_to_pb(spec)))

    def describe_dataset(self, name: str, spec_only: bool = False, partition_limit: int = 0) -> pb.DatasetInfo:
        """The dataset's spec, partitions and counts; ``spec_only``: its spec, kind and schema only (cheaper);
        ``partition_limit`` > 0: only that many partitions, the most lagging first (0: all, by index)."""
        request = pb.DescribeDatasetRequest(name=name, spec_only=spec_only, partition_limit=partition_limit)
        return self._call(self._stub.DescribeDataset, request)

    def remove_dataset(self, name: str) -> pb.RemoveDatasetResponse:
        """Remove a dataset (its leases are revoked, its shards and cursor entries deleted).

        A retry answered NOT_FOUND after a transient failure means the first try removed it: answered with zero
        counts (those of the first try were lost with its answer).
        """
        request = pb.RemoveDatasetRequest(name=name)
        return self._transport.call(self._stub.RemoveDataset, request, gone=pb.RemoveDatasetResponse())

    def list_datasets(self, partition_limit: int = 0) -> list[pb.DatasetInfo]:
        """Every registered dataset with its counts and partitions: the 20 most lagging (``partition_limit`` 0),
        N, or all (-1); ``partition_count`` counts them all."""
        request = pb.ListDatasetsRequest(partition_limit=partition_limit)
        return list(self._call(self._stub.ListDatasets, request).datasets)

    def resume_dataset(self, name: str, skip_lost: bool = False) -> pb.ResumeDatasetResponse:
        """Resume a FAILED dataset (once its cause is fixed); ``resumed`` is False if it was not failed.

        ``skip_lost``: records deleted upstream so far are accounted as lost (as ``sr.on_data_loss=skip`` does).
        """
        return self._call(self._stub.ResumeDataset, pb.ResumeDatasetRequest(name=name, skip_lost=skip_lost))

    def commit_staged(
        self,
        dataset: str,
        producer: str,
        part: str,
        epoch: int,
        files: Sequence[tuple[str, int]],
        settled: bool = False,
        previous_epoch: int | None = None,
    ) -> pb.CommitStagedResponse:
        """Commit staged Parquet files ``(uri, records)`` to a staged dataset, once per (producer, part, epoch).

        A repeat of a committed key answers ``already_committed`` and adds nothing (safe to retry).
        ``settled``: every epoch <= ``epoch`` of (producer, part) is committed or never will be, so the master
        may delete their uncommitted staging (a producer that commits in order, as Spark does; see the .proto).
        ``previous_epoch``: the epoch of (producer, part)'s commit before this one, when known; the master shows
        it as a gap while that commit has not arrived, and fails the dataset once it is missing for longer than
        ``sr.commit_gap_ms`` (unless ``sr.on_data_loss=skip``).
        """
        staged = [pb.StagedFile(uri=uri, records=records) for uri, records in files]
        request = pb.CommitStagedRequest(
            dataset=dataset, producer=producer, part=part, epoch=epoch, files=staged, settled=settled
        )
        if previous_epoch is not None:
            request.previous_epoch = previous_epoch
        return self._call(self._stub.CommitStaged, request)

    def status(self, partition_limit: int = 0) -> pb.StatusResponse:
        """The job's status: datasets (with partitions as :meth:`list_datasets`), workers, rates, the last
        committed cut."""
        return self._call(self._stub.Status, pb.StatusRequest(partition_limit=partition_limit))

    def stop(self, reason: str = "") -> None:
        """Stop the master (admin token only: PermissionDeniedError with a worker token). Sent once, not retried."""
        try:
            self._stub.Stop(pb.StopRequest(reason=reason), metadata=self._transport.metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._transport.error(exc.code().name, exc.details() or "") from None

    def report(self, values: Mapping[str, float], step: int | None = None, reporter: str | None = None) -> None:
        """Report trainer metrics (``client.report({"loss": 0.41, "auc": 0.78}, step=120)``) to the master:
        its Prometheus ``/metrics`` (``streamrover_trainer_metric``) and dashboard show them.

        ``reporter`` defaults to the client's name (e.g. ``rank0@node``; a StreamSession names it so).
        """
        request = pb.ReportMetricsRequest(reporter=reporter or self.name, values=dict(values))
        if step is not None:
            request.has_step, request.step = True, step
        self._call(self._stub.ReportMetrics, request)

    def commit_cut(self, cut_id: int) -> DataCursor:
        """Commit a prepared cut (its manifest is durable). Does not wait for queued acks: the cut is fixed."""
        resp = self._call(self._stub.CutCommit, pb.CutCommitRequest(cut_id=cut_id))
        return convert.cursor_from_pb(resp.committed)

    # ---------------------------------------------------------------- key-value
    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version) of ``key``, or None when it was never set."""
        resp = self._call(self._stub.KvGet, pb.KvGetRequest(key=key))
        return (resp.value, resp.version) if resp.found else None

    def kv_set(self, key: str, value: bytes, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-set; returns (written, current value, current version).

        The write carries an id of its own (the same in its retries): a retry after it landed is answered written.
        """
        request = pb.KvSetRequest(key=key, value=value, expected_version=expected_version, writer=_writer())
        resp = self._call(self._stub.KvSet, request)
        return resp.ok, resp.value, resp.version

    def kv_delete(self, key: str, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-delete; returns (deleted, current value, current version) — (True, b"", 0) once gone."""
        request = pb.KvSetRequest(key=key, expected_version=expected_version, delete=True, writer=_writer())
        resp = self._call(self._stub.KvSet, request)
        return resp.ok, resp.value, resp.version

    def kv_delete_range(self, key: str, range_end: str) -> int:
        """Remove every key ``k`` with ``key <= k < range_end``, whatever its version; returns how many."""
        resp = self._call(self._stub.KvDeleteRange, pb.KvDeleteRangeRequest(key=key, range_end=range_end))
        return int(resp.deleted)


__all__ = ["AdminClient"]
