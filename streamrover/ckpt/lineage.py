"""Lineage: which offset ranges per partition a checkpoint's model has learned from (ARCHITECTURE.md, Observability).

It is the data cursor bound to the checkpoint, written out readable in the manifest's ``lineage``
section (the ``cursor`` field stays the source of truth a restore reads)::

    "lineage": {"learned": [{"dataset": "clicks", "epoch": 0, "partition": "clicks-0",
                             "ranges": [[0, 4200]], "positions": 4200}, ...],
                "lost": [...],          # deleted upstream before they were trained: never learned from
                "positions": 8400}

Positions are source positions (Kafka/RocketMQ offsets, file row indexes, Pulsar's encoded ids): a range
``[start, end)`` holds ``end - start`` positions, which are records where the source's positions are dense
(files, RocketMQ, Kafka without compaction or transaction markers). Manifests written before this section
existed get it derived from their cursor. :func:`list_checkpoints` reads every checkpoint of a storage URL,
and :func:`new_since` tells what a checkpoint learned beyond the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamrover.ckpt.api import CheckpointError, CorruptCheckpointError
from streamrover.ckpt.layout import MANIFEST, lineage_of, list_steps, read_manifest, step_dir
from streamrover.ckpt.storage import Storage
from streamrover.cursor import CursorError, DataCursor


def new_since(cursor: DataCursor, previous: DataCursor) -> DataCursor:
    """The positions of ``cursor`` that ``previous`` does not hold: what was learned since that checkpoint."""
    out = DataCursor()
    for key, intervals in cursor.items():
        before = previous.get(key)
        for start, end in intervals:
            for a, b in before.missing(start, end):
                out.add(key, a, b)
    return out


@dataclass
class CheckpointInfo:
    """One checkpoint directory on storage: complete (its manifest verifies) or not, and its lineage."""

    step: int
    complete: bool
    world_size: int = 0
    cut_ids: list[int] = field(default_factory=list)
    cursor: DataCursor = field(default_factory=DataCursor)
    lineage: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why it is not complete (no manifest yet, a checksum failed...)


def read_checkpoint(storage: Storage, step: int) -> CheckpointInfo:
    """The checkpoint of ``step``: its manifest verified (checksums), its lineage (derived for older manifests)."""
    if not storage.exists(storage.join(step_dir(step), MANIFEST)):
        return CheckpointInfo(step, False, error="no manifest: partial (being written, or its persist failed)")
    try:
        manifest = read_manifest(storage, step)
        cursor = DataCursor.from_json(manifest["cursor"])
    except (CorruptCheckpointError, CursorError, KeyError, ValueError) as exc:
        return CheckpointInfo(step, False, error=f"corrupt: {exc}")
    return CheckpointInfo(
        step,
        True,
        world_size=int(manifest.get("world_size", 0)),
        cut_ids=[int(c) for c in manifest.get("cut_ids", [])],
        cursor=cursor,
        lineage=manifest.get("lineage") or lineage_of(cursor),
    )


def list_checkpoints(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``url`` (any fsspec URL or a local path), oldest first."""
    storage = Storage(url, storage_options)
    if not storage.exists(storage.root):
        raise CheckpointError(f"{url}: no such checkpoint directory (give the trainer's --ckpt-dir)")
    return [read_checkpoint(storage, s) for s in list_steps(storage)]


__all__ = ["CheckpointInfo", "lineage_of", "list_checkpoints", "new_since", "read_checkpoint"]
