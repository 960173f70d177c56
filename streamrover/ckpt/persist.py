"""Persist one snapshot buffer to storage: its part, then the manifest once all parts exist, then retention.

Runs in the saver (a process that outlives the trainer). It reads the snapshot straight
from shared memory and streams it into a safetensors file without an intermediate copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from streamrover.ckpt.api import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    PersistResult,
    RetentionPolicy,
)
from streamrover.ckpt.layout import (
    MANIFEST,
    build_manifest,
    complete_steps,
    list_steps,
    part_names,
    safetensors_header,
    sealed,
    step_dir,
    unseal,
)
from streamrover.ckpt.shm import SharedBuffer
from streamrover.ckpt.storage import CHECKSUM_ALGO, Storage

log = logging.getLogger(__name__)


class SupersededError(CheckpointError):
    """The snapshot changed in shared memory while it was being persisted (it is not persisted)."""


@dataclass
class PersistTarget:
    """Where one rank's snapshots go."""

    storage: Storage
    rank: int
    world_size: int
    retention: RetentionPolicy
    checksum_algo: str = CHECKSUM_ALGO


def already_persisted(target: PersistTarget, step: int, seq: int) -> bool:
    """True if this rank's part of ``step`` on storage holds snapshot ``seq``."""
    path = target.storage.join(step_dir(step), part_names(target.rank)[1])
    if not target.storage.exists(path):
        return False
    try:
        part = unseal(target.storage.read(path), path)
    except (CorruptCheckpointError, OSError):
        return False
    return bool(part.get("seq") == seq)


def persist_buffer(
    target: PersistTarget, buf: SharedBuffer, expected_gen: int | None, yield_to_saves: bool = True
) -> PersistResult:
    """Write the snapshot in ``buf`` (at ``expected_gen`` if given) as this rank's part of its step.

    ``yield_to_saves``: pause while the trainer copies a new snapshot (:meth:`SharedBuffer.wait_while_paused`);
    off once the trainer is dead (a pause it left would only delay the persist its restart waits for).
    """
    found = buf.read_header()
    if found is None or (expected_gen is not None and found[0] != expected_gen):
        raise SupersededError(f"buffer {buf.name} no longer holds generation {expected_gen}")
    gen, header = found
    step = int(header["step"])
    storage = target.storage
    d = step_dir(step)
    tensors_name, part_name = part_names(target.rank)
    rows: list[dict[str, Any]] = header["tensors"]
    st_header, order = safetensors_header(rows)
    view = memoryview(buf.mm)
    pieces: list[Any] = [st_header]
    pieces += [view[int(rows[i]["offset"]) : int(rows[i]["offset"]) + int(rows[i]["nbytes"])] for i in order]
    tensors_path = storage.join(d, tensors_name)
    try:
        pause = buf.wait_while_paused if yield_to_saves else None
        nbytes, digest = storage.write(tensors_path, pieces, target.checksum_algo, pause=pause)
    finally:
        del pieces, view
    if not buf.still_valid(gen):
        storage.remove(tensors_path)
        raise SupersededError(f"buffer {buf.name} was overwritten while step {step} was being persisted")
    part = {
        "format": FORMAT_VERSION,
        "step": step,
        "rank": target.rank,
        "world_size": target.world_size,
        "seq": header["seq"],
        "skeleton": header["skeleton"],
        "tensors": [{k: r[k] for k in ("kind", "dtype", "shape", "nbytes")} for r in rows],
        "cursor": header.get("cursor"),
        "cut_id": header.get("cut_id"),
        "meta": header.get("meta") or {},
        "tensors_checksum": digest,
        "tensors_bytes": nbytes,
    }
    storage.write_bytes(storage.join(d, part_name), sealed(part), target.checksum_algo)
    published = publish_if_complete(target, step)
    return PersistResult(step=step, ok=True, manifest_published=published, cut_id=header.get("cut_id"))


def publish_if_complete(target: PersistTarget, step: int) -> bool:
    """Publish the manifest of ``step`` if every rank's part is written, then apply retention."""
    storage = target.storage
    manifest = build_manifest(storage, step, target.world_size)
    if manifest is None:
        return False
    storage.write_bytes(storage.join(step_dir(step), MANIFEST), manifest, target.checksum_algo)
    apply_retention(target)
    return True


def apply_retention(target: PersistTarget) -> None:
    """Delete the checkpoints the policy drops, and partial ones older than the newest complete one."""
    storage = target.storage
    complete = complete_steps(storage)
    if not complete:
        return
    drop = set(target.retention.to_delete(complete))
    newest = complete[-1]
    drop.update(s for s in list_steps(storage) if s < newest and s not in complete)
    for step in sorted(drop):
        d = storage.join(step_dir(step))
        storage.remove(storage.join(step_dir(step), MANIFEST))  # unpublish first: never a half-deleted checkpoint
        storage.remove_tree(d)
        log.debug("retention removed %s", d)
