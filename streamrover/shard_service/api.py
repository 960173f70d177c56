"""The shard service's contract in Python terms: specs, shard states, leases, errors.

Reading this module tells what the service promises; ``core.py`` keeps the
promises, ``journal.py`` makes them durable, ``server.py`` and ``client.py``
carry them over gRPC.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_RECORDS_PER_SHARD = 10_000  # streams
MAX_AUTO_RECORDS_PER_SHARD = 1 << 18  # batch files: one shard per row group, up to this many rows
DEFAULT_LEASE_TTL = 10.0


class ShardServiceError(Exception):
    """Base of the errors the service returns; ``code`` is the gRPC status name."""

    code = "INTERNAL"


class InvalidArgumentError(ShardServiceError):
    code = "INVALID_ARGUMENT"


class NotFoundError(ShardServiceError):
    code = "NOT_FOUND"


class AlreadyExistsError(ShardServiceError):
    code = "ALREADY_EXISTS"


class FailedPreconditionError(ShardServiceError):
    """The request is well-formed but the state forbids it (stale lease, old cut...)."""

    code = "FAILED_PRECONDITION"


class StaleLeaseError(FailedPreconditionError):
    """An ack or progress report for a lease that is no longer current."""


class UnauthenticatedError(ShardServiceError):
    code = "UNAUTHENTICATED"


class UnavailableError(ShardServiceError):
    code = "UNAVAILABLE"


class ShardState(enum.Enum):
    TODO = "todo"  # waiting in the queue
    LEASED = "leased"  # held by one worker under one attempt
    ACKED = "acked"  # every position acked; not yet folded into the committed cursor
    # Shards inside the committed cursor are deleted from the journal (compaction).


class LeaseStatus(enum.Enum):
    OK = "ok"
    WAIT = "wait"  # nothing to lease now
    END = "end"  # batch dataset finished


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    uri: str
    format: str = ""
    options: dict[str, str] = field(default_factory=dict)
    records_per_shard: int = 0
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0

    def normalized(self) -> DatasetSpec:
        return DatasetSpec(
            name=self.name,
            uri=self.uri,
            format=self.format,
            options=dict(sorted(self.options.items())),
            records_per_shard=self.records_per_shard,
            epochs=max(self.epochs, 1),
            shuffle=self.shuffle,
            seed=self.seed,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetSpec:
        data: dict[str, Any] = json.loads(text)
        return cls(**data)

    def validate(self) -> None:
        if self.records_per_shard < 0:
            raise InvalidArgumentError(f"dataset {self.name!r}: records_per_shard must be positive")
        if self.epochs < 0:
            raise InvalidArgumentError(f"dataset {self.name!r}: epochs must be positive")
        if not self.uri:
            raise InvalidArgumentError(f"dataset {self.name!r}: uri is empty")


@dataclass(frozen=True)
class PartitionPlan:
    """A partition as the service plans it: its index, source id, and planned extent ``[start, end)``."""

    index: int
    id: str
    start: int
    end: int


@dataclass(frozen=True)
class LeaseGrant:
    shard_id: str
    attempt: int
    dataset: str
    epoch: int
    partition: PartitionPlan
    start: int
    end: int
    resume: int
    deadline: float


@dataclass(frozen=True)
class AckResult:
    shard_done: bool
    duplicate: bool


def shard_id_for(dataset: str, epoch: int, partition_index: int, start: int, end: int) -> str:
    """A shard's id is its coordinates: ``dataset/epoch/partition-index/start-end``. Never a counter."""
    return f"{dataset}/{epoch}/{partition_index}/{start}-{end}"


def parse_shard_id(shard_id: str) -> tuple[str, int, int, int, int] | None:
    """The coordinates in a shard id, or None when it is not one."""
    try:
        dataset, epoch, pindex, span = shard_id.rsplit("/", 3)
        start, end = span.split("-", 1)
        return dataset, int(epoch), int(pindex), int(start), int(end)
    except ValueError:
        return None
