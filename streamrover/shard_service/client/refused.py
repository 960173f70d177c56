"""A shared-memory snapshot the master refused to restore, as both contracts name it.

:meth:`CursorClient.restore_cursor <streamrover.shard_service.client.cursor_client.CursorClient.restore_cursor>`
with ``from_memory`` raises :class:`SnapshotRefusedError` where the master answers ``FAILED_PRECONDITION`` (the
snapshot is not of its journal's run): a :class:`~streamrover.shard_service.api.FailedPreconditionError`, as the
shard service's contract says, and the checkpoints' :class:`streamrover.ckpt.api.SnapshotRefusedError`, which
``Checkpointer.load`` catches to discard the snapshot and load storage. Imported only when a refusal happens, so
``import streamrover.shard_service`` does not import :mod:`streamrover.ckpt`.
"""

from __future__ import annotations

from streamrover.ckpt import api as ckpt_api
from streamrover.shard_service.api import FailedPreconditionError


class SnapshotRefusedError(FailedPreconditionError, ckpt_api.SnapshotRefusedError):
    """The master refused a shared-memory snapshot's cursor: it is not of this run (see the module docstring)."""


__all__ = ["SnapshotRefusedError"]
