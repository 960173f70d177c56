"""The ``CommitStaged`` RPC: files checked outside the service lock, committed under it, staging collected after.

Staging is collected only after a ``settled`` commit (see the .proto): what no commit can still claim.

The servicer binds :func:`commit_staged` as its ``CommitStaged`` method (``server.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from streamrover.shard_service.api import InvalidArgumentError
from streamrover.shard_service.master.staged import StagedOutcome
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import SourceError
from streamrover.sources.staged import (
    FileFacts,
    delete_files,
    delete_trained,
    inspect_file,
    staging_garbage,
    validate_key_part,
)

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.master.server import ShardServicer

log = logging.getLogger(__name__)
#: Files one commit may name (a sink's subtask stages a few per checkpoint): each is opened to read its footer, so
#: a commit of more is refused INVALID_ARGUMENT before any is opened, as a request over the size limit is.
MAX_FILES_PER_COMMIT = 10_000


def check_files(request: pb.CommitStagedRequest) -> list[FileFacts]:
    """Read each file's footer: it must exist, be Parquet and hold ``records`` rows. INVALID_ARGUMENT otherwise."""
    seen: set[str] = set()
    facts = []
    for f in request.files:
        if not f.uri:
            raise InvalidArgumentError(f"commit of {request.dataset!r}: a staged file has an empty uri")
        if f.uri in seen:
            raise InvalidArgumentError(f"commit of {request.dataset!r}: staged file {f.uri!r} is named twice")
        seen.add(f.uri)
        try:
            fact = inspect_file(f.uri)
        except SourceError as exc:  # missing or unreadable: the commit's argument is wrong, not the dataset
            raise InvalidArgumentError(str(exc)) from exc
        if fact.rows != f.records:
            raise InvalidArgumentError(f"staged file {f.uri!r} holds {fact.rows} records, the commit says {f.records}")
        facts.append(fact)
    return facts


def collect_garbage(outcome: StagedOutcome, producer: str, part: str, epoch: int) -> int:
    """Delete the (producer, part)'s uncommitted staging of epochs <= ``epoch``. A failure is logged, not raised."""
    if not outcome.staging_dir:
        return 0
    try:
        return delete_files(staging_garbage(outcome.staging_dir, producer, part, epoch, outcome.keep))
    except OSError as exc:  # the commit stands; the next commit of this (producer, part) tries again
        log.warning("staging under %s/%s/%s not collected: %s", outcome.staging_dir, producer, part, exc)
        return 0


def delete_trained_files(files: dict[str, list[str]]) -> int:
    """Retention: delete trained committed files (``StagedCommits.trained_staged_files``). Failures are logged."""
    deleted = 0
    for staging_dir, urls in files.items():
        try:
            deleted += delete_trained(staging_dir, urls)
        except OSError as exc:  # the files stay; nothing depends on their deletion
            log.warning("trained staged files under %s not deleted: %s", staging_dir, exc)
    return deleted


def commit_staged(self: ShardServicer, request: pb.CommitStagedRequest, context: Any) -> pb.CommitStagedResponse:
    """Commit a sink's staged files under (producer, part, epoch), once; see the .proto for the contract."""
    if len(request.files) > MAX_FILES_PER_COMMIT:
        raise InvalidArgumentError(f"commit of {request.dataset!r} names {len(request.files)} files, more than "
                                   f"{MAX_FILES_PER_COMMIT} per commit: write larger files (rows per file)")
    try:
        validate_key_part("producer", request.producer)
        validate_key_part("part", request.part)
    except SourceError as exc:
        raise InvalidArgumentError(f"commit of {request.dataset!r}: {exc}") from exc
    if request.epoch < 0:
        raise InvalidArgumentError(f"commit of {request.dataset!r}: epoch must be >= 0, got {request.epoch}")
    previous = request.previous_epoch if request.HasField("previous_epoch") else None
    if previous is not None and not 0 <= previous < request.epoch:
        raise InvalidArgumentError(
            f"commit of {request.dataset!r}: previous_epoch must be >= 0 and below epoch {request.epoch}, "
            f"got {previous} (leave it unset when the previous epoch is not known)"
        )
    key = (request.dataset, request.producer, request.part, request.epoch)
    with self.cond:
        outcome = self.core.staged.staged_commit(*key)
    if outcome is None:
        facts = check_files(request)  # I/O outside the lock
        with self.cond:
            outcome = self.core.staged.commit_staged(*key, facts, previous)
            if not outcome.already:
                self.cond.notify_all()  # lease calls waiting for shards
    if request.settled:  # else a commit of an earlier epoch may still come (Flink): nothing is garbage yet
        collect_garbage(outcome, request.producer, request.part, request.epoch)
    return pb.CommitStagedResponse(already_committed=outcome.already, records=outcome.records)
