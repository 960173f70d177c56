"""A leased shard on the worker side: read its records from the source, ack positions.

:class:`LeasedShard` objects come from :meth:`ShardClient.lease` / :meth:`ShardClient.shards`;
acks go through the client that leased them (queued or synchronous, see
:mod:`streamrover.shard_service.client`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol, overload

import pyarrow as pa

from streamrover.shard_service.api import AckResult, FailedPreconditionError, LeaseGrant, LeaseLostError
from streamrover.sources.api import Partition, ReadBatch, Source, SourceNotFoundError, SourceUnreadableError

DEFAULT_BATCH_SIZE = 4096


class HeldLeases(Protocol):
    """The client's table of held leases, as a leased shard uses it (``lease_table.LeaseTable``)."""

    def is_revoked(self, shard: LeasedShard) -> bool: ...

    def finished(self, shard: LeasedShard) -> None: ...


class LeasePacing(Protocol):
    """The client's pacing, as a leased shard uses it (``pacing.Pacing``)."""

    def leases_wanted(self, dataset: str) -> int: ...


class LeaseHolder(Protocol):
    """What a leased shard needs of the client that leased it (:class:`ShardClient` keeps it).

    A protocol, so that this module does not import the client module, which imports this one.
    """

    @property
    def leases(self) -> HeldLeases: ...

    @property
    def pacing(self) -> LeasePacing: ...

    def send_ack(
        self,
        lease: LeaseGrant,
        shard: LeasedShard | None,
        position: int,
        step: int | None,
        dead_letters: int,
        lease_more: int,
        wait: bool | None,
    ) -> AckResult | None: ...

    def report_unreadable(self, lease: LeaseGrant, position: int, error: Exception) -> bool: ...


class LeasedShard:
    """A shard this worker holds: read its records from the source and ack positions."""

    def __init__(self, client: LeaseHolder, lease: LeaseGrant, source: Source) -> None:
        self.client = client
        self.lease = lease
        self.source = source
        self.position = lease.resume  # next position to read
        self.acked = lease.resume  # recorded by the master (queued acks count once they are answered)
        self.done = False
        self._dead_letters = 0  # read but not yet acked

    @property
    def shard_id(self) -> str:
        """The leased shard's id."""
        return self.lease.shard_id

    @property
    def revoked(self) -> bool:
        """Whether the lease was taken back (stop reading; do not ack)."""
        return self.client.leases.is_revoked(self)

    def batches(self, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[ReadBatch]:
        """The shard's records from its resume position to its end. Stops early if the lease is revoked."""
        part = Partition(self.lease.partition.id, self.lease.partition.start, self.lease.partition.end)
        try:
            yield from self._read(part, batch_size)
        except (SourceNotFoundError, SourceUnreadableError) as exc:  # the data is gone? the master checks
            if self.client.report_unreadable(self.lease, self.position, exc):  # DataLostError: the dataset failed
                raise LeaseLostError(f"shard {self.shard_id!r}: its data is gone, skipped as lost: {exc}") from exc
            raise

    def _read(self, part: Partition, batch_size: int) -> Iterator[ReadBatch]:
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

    @overload
    def ack(self, position: int | None = None, step: int | None = None, *, wait: Literal[True]) -> AckResult: ...

    @overload
    def ack(
        self, position: int | None = None, step: int | None = None, *, wait: bool | None = None
    ) -> AckResult | None: ...

    def ack(
        self, position: int | None = None, step: int | None = None, *, wait: bool | None = None
    ) -> AckResult | None:
        """Say the records before ``position`` (default: everything read so far) are applied (after ``step``).

        Queued when ``wait`` is False (the default of a client made with ``async_acks=True``):
        returns None at once and the client's sender thread sends it, in order; :attr:`acked`
        and :attr:`done` follow when the master answers. With ``wait=True`` (the default
        otherwise) it waits for every ack queued before it, then for its own answer, and
        returns it.

        Raises :class:`LeaseLostError` when the lease is gone: an earlier queued ack of it
        was refused (FAILED_PRECONDITION), or, waiting, this one is. Stop applying the
        shard's records then; the ones applied but not acked will be handed out again.
        """
        pos = self.position if position is None else position
        more = self.client.pacing.leases_wanted(self.lease.dataset) if pos == self.lease.end else 0
        try:
            result = self.client.send_ack(self.lease, self, pos, step, self._dead_letters, more, wait)
        except LeaseLostError:
            raise
        except FailedPreconditionError as exc:
            raise LeaseLostError(str(exc)) from exc
        self._dead_letters = 0
        return result

    def answered(self, position: int, done: bool) -> None:
        """The master recorded an ack of this lease (called by whichever thread got the answer)."""
        self.acked = max(self.acked, position)
        if done:
            self.done = True
            self.client.leases.finished(self)
