"""The shard service (job master): datasets, shards, fenced leases and acks, the durable cursor.

Public API: the contract in :mod:`~streamrover.shard_service.api` (:class:`ShardService`,
:class:`Shard`, :class:`DatasetSpec`, the error types), :class:`ShardClient` that keeps it over
gRPC for workers and tools, and :class:`MasterServer` to run a master in-process.

Layout: ``api.py`` (the contract; its error types in ``errors.py``), ``v1/`` (the wire), ``convert.py``
(messages <-> types, both sides), :mod:`~streamrover.shard_service.master` (what runs only in the job master)
and :mod:`~streamrover.shard_service.client` (what a worker runs); those two never import each other.
"""

from typing import TYPE_CHECKING

from streamrover.shard_service.api import (
    AckFailedError,
    AckFailure,
    AckResult,
    AlreadyExistsError,
    DataLostError,
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseGrant,
    LeaseLostError,
    LeaseStatus,
    NotFoundError,
    PermissionDeniedError,
    Shard,
    ShardService,
    ShardServiceError,
    StaleLeaseError,
    UnauthenticatedError,
    UnavailableError,
)
from streamrover.shard_service.client.leased import LeasedShard
from streamrover.shard_service.client.shard_client import ShardClient
from streamrover.shard_service.master.process import MasterServer, load_or_create_token

__all__ = [
    "AckFailedError",
    "AckFailure",
    "AckResult",
    "AlreadyExistsError",
    "DataLostError",
    "DatasetSpec",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "LeaseGrant",
    "LeaseLostError",
    "LeaseStatus",
    "LeasedShard",
    "MasterServer",
    "NotFoundError",
    "PermissionDeniedError",
    "Shard",
    "ShardClient",
    "ShardService",
    "ShardServiceError",
    "StaleLeaseError",
    "UnauthenticatedError",
    "UnavailableError",
    "load_or_create_token",
]

if TYPE_CHECKING:  # the gRPC client keeps the contract (mypy checks it here)
    _CLIENT: type[ShardService] = ShardClient
    _LEASED: type[Shard] = LeasedShard
