"""The shard service's errors: every refusal is a :class:`ShardServiceError` whose ``code`` is a gRPC status.

The contract (:mod:`streamrover.shard_service.api`, its **Errors** paragraph) says when each is raised, and
re-exports them all: import them from there. They live here so the contract module stays short; the server
answers each with its ``code``, and the client turns each status back into its class
(``client/transport.py``).
A master whose journal cannot be written stops with ``journal.JournalWriteError``, deliberately not one of these.
"""

from __future__ import annotations

from dataclasses import dataclass


class ShardServiceError(Exception):
    """Base of the errors the service returns; ``code`` is the gRPC status name."""

    code = "INTERNAL"


class InvalidArgumentError(ShardServiceError):
    """The request is malformed: the message names the bad field or value."""

    code = "INVALID_ARGUMENT"


class NotFoundError(ShardServiceError):
    """The request names a dataset, shard, worker or cut the service does not know (or no longer remembers)."""

    code = "NOT_FOUND"


class AlreadyExistsError(ShardServiceError):
    """A dataset of that name is registered with a different spec."""

    code = "ALREADY_EXISTS"


class FailedPreconditionError(ShardServiceError):
    """The request is well-formed but the state forbids it (stale lease, old cut...)."""

    code = "FAILED_PRECONDITION"


class StaleLeaseError(FailedPreconditionError):
    """An ack or progress report for a lease that is no longer current."""


class LeaseLostError(StaleLeaseError):
    """This worker no longer holds the shard: stop applying its records."""


class DataLostError(FailedPreconditionError):
    """A leased shard's data can no longer be read (a file deleted before it was trained): the dataset failed."""


class UnauthenticatedError(ShardServiceError):
    """The call carried no token or the wrong one (the master's state directory holds the right one)."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(ShardServiceError):
    """The token's role may not make this call (a worker token on an administrator's call): see ``api.ADMIN_CALLS``."""

    code = "PERMISSION_DENIED"


class UnavailableError(ShardServiceError):
    """No master answered within the client's timeout (calls retry ``UNAVAILABLE`` until then)."""

    code = "UNAVAILABLE"


@dataclass(frozen=True)
class AckFailure:
    """An ack the master refused after ``ack()`` had returned (a queued ack)."""

    shard_id: str
    attempt: int
    position: int
    step: int | None
    error: ShardServiceError

    @property
    def lease_lost(self) -> bool:
        """The lease is gone (stale attempt, revoked, unknown shard or worker): its records are not acked."""
        return isinstance(self.error, (FailedPreconditionError, NotFoundError))

    def __str__(self) -> str:
        step = "" if self.step is None else f" (step {self.step})"
        return f"ack of shard {self.shard_id!r} attempt {self.attempt} at {self.position}{step}: {self.error}"


class AckFailedError(ShardServiceError):
    """Acks sent in the background were refused; :attr:`failures` says which and why.

    The records of a lost lease were applied by this worker but are not acked: the
    shard service will hand them out again. State bound to checkpoints must restart
    from the last checkpoint; a sink that fences writes by position can note it and go on.
    """

    def __init__(self, failures: list[AckFailure]) -> None:
        self.failures = failures
        self.code = failures[0].error.code if failures else "INTERNAL"
        shown = "; ".join(str(f) for f in failures[:3])
        more = f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
        super().__init__(f"{len(failures)} ack(s) sent in the background were refused: {shown}{more}")
