"""The shard service (job master): datasets, shards, fenced leases and acks, the durable cursor.

Public API: :class:`ShardClient` for workers and tools, :class:`MasterServer` to
run a master in-process, :class:`DatasetSpec`, and the error types.
"""

from streamrover.shard_service.api import (
    AckResult,
    AlreadyExistsError,
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    ShardServiceError,
    StaleLeaseError,
    UnauthenticatedError,
    UnavailableError,
)
from streamrover.shard_service.client import ShardClient
from streamrover.shard_service.client_acks import AckFailedError, AckFailure
from streamrover.shard_service.leased import LeasedShard, LeaseLostError
from streamrover.shard_service.master import MasterServer, load_or_create_token

__all__ = [
    "AckFailedError",
    "AckFailure",
    "AckResult",
    "AlreadyExistsError",
    "DatasetSpec",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "LeaseGrant",
    "LeaseLostError",
    "LeaseStatus",
    "LeasedShard",
    "MasterServer",
    "NotFoundError",
    "ShardClient",
    "ShardServiceError",
    "StaleLeaseError",
    "UnauthenticatedError",
    "UnavailableError",
    "load_or_create_token",
]
