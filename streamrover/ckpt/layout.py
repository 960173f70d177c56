"""The persisted form of a checkpoint: directory layout, safetensors parts, part and manifest JSON.

::

    <root>/step-000000000100/
        rank-00000.safetensors   tensors of rank 0 (standard safetensors; any reader can open it)
        rank-00000.json          rank 0's part: state skeleton, tensor table, cursor, cut id, file checksum
        MANIFEST.json            published last, once every rank's part exists: the checkpoint exists iff it does

The manifest holds the checksums of every part file and of itself; the loader checks
them all before handing out a state. Nothing here unpickles.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from streamrover.ckpt.api import FORMAT_VERSION, CorruptCheckpointError
from streamrover.ckpt.flatten import DTYPES, make_tensor, unflatten
from streamrover.ckpt.storage import Storage, checksum
from streamrover.cursor import CursorError, DataCursor, IntervalSet, PartitionKey

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{12})$")


def step_dir(step: int) -> str:
    """The directory name of step ``step``'s checkpoint (zero-padded: names sort as steps do)."""
    return f"step-{step:012d}"


def part_names(rank: int) -> tuple[str, str]:
    """The file names of rank ``rank``'s part: (tensor data, part document)."""
    return f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"


def list_steps(storage: Storage) -> list[int]:
    """Steps that have a checkpoint directory (complete or not), ascending."""
    steps = []
    for name in storage.listdir(storage.root):
        m = _STEP_DIR.match(name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def complete_steps(storage: Storage) -> list[int]:
    """Steps whose checkpoint is complete (its manifest is published), ascending."""
    return [s for s in list_steps(storage) if storage.exists(storage.join(step_dir(s), MANIFEST))]


# -- safetensors -------------------------------------------------------------------
def safetensors_header(rows: list[dict[str, Any]]) -> tuple[bytes, list[int]]:
    """The safetensors header for tensors ``rows`` and the order their bytes follow it in.

    Tensors are packed without gaps (safetensors' rule), widest dtype first, so every
    tensor starts aligned to its item size and loads as a view of the file's bytes.
    """
    table: dict[str, Any] = {"__metadata__": {"format": "streamrover", "version": str(FORMAT_VERSION)}}
    order = sorted(range(len(rows)), key=lambda i: (-DTYPES[rows[i]["dtype"]][2], i))
    pos = 0
    for i in order:
        row = rows[i]
        table[f"t{i}"] = {"dtype": row["dtype"], "shape": row["shape"], "data_offsets": [pos, pos + int(row["nbytes"])]}
        pos += int(row["nbytes"])
    blob = json.dumps(table, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)  # data starts 8-byte aligned
    return len(blob).to_bytes(8, "little") + blob, order


def parse_safetensors(data: bytearray) -> tuple[dict[str, Any], int]:
    """The header table of a safetensors file and where its data starts; checks every bound."""
    if len(data) < 8:
        raise CorruptCheckpointError("safetensors file is shorter than its length prefix")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise CorruptCheckpointError(f"safetensors header length {n} runs past the end of the file")
    try:
        table = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as exc:
        raise CorruptCheckpointError(f"safetensors header is not JSON: {exc}") from exc
    base = 8 + n
    for name, info in table.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES or not 0 <= begin <= end <= len(data) - base:
            raise CorruptCheckpointError(f"safetensors entry {name!r} is out of bounds or has an unknown dtype")
        count = 1
        for dim in info["shape"]:
            count *= int(dim)
        if end - begin != count * DTYPES[info["dtype"]][2]:
            raise CorruptCheckpointError(f"safetensors entry {name!r}: {end - begin} bytes for shape {info['shape']}")
    return table, base


# -- JSON documents -------------------------------------------------------------------
def sealed(doc: dict[str, Any]) -> bytes:
    """``doc`` as canonical JSON with its own checksum in ``"self_checksum"``."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc = {**doc, "self_checksum": checksum(body)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), indent=None).encode()


def unseal(blob: bytes | bytearray, what: str) -> dict[str, Any]:
    """The JSON document ``blob`` less its ``self_checksum``, once that checks; :class:`CorruptCheckpointError`
    (naming ``what``) otherwise.
    """
    try:
        doc = json.loads(bytes(blob))
    except ValueError as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or "self_checksum" not in doc:
        raise CorruptCheckpointError(f"{what} has no self_checksum")
    claimed = doc.pop("self_checksum")
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    if checksum(body, str(claimed).split(":", 1)[0]) != claimed:
        raise CorruptCheckpointError(f"{what} fails its checksum")
    return doc


def _entries(items: list[tuple[PartitionKey, IntervalSet]]) -> list[dict[str, Any]]:
    fields = ("dataset", "epoch", "partition")
    return [
        {**dict(zip(fields, (k.dataset, k.epoch, k.partition))), "ranges": iv.to_list(), "positions": iv.size()}
        for k, iv in items
        if iv
    ]


def lineage_of(cursor: DataCursor) -> dict[str, Any]:
    """The manifest's ``lineage`` section: the cursor's offset ranges per partition, readable (see ``lineage.py``)."""
    return {"learned": _entries(cursor.items()), "lost": _entries(cursor.lost_items()), "positions": cursor.size()}


def build_manifest(storage: Storage, step: int, world_size: int) -> bytes | None:
    """The manifest of ``step`` if every rank's part is written, else None."""
    d = step_dir(step)
    parts: dict[str, Any] = {}
    cursor = DataCursor()
    cut_ids: set[int] = set()
    for rank in range(world_size):
        tensors_name, part_name = part_names(rank)
        path = storage.join(d, part_name)
        if not storage.exists(path):
            return None
        blob = storage.read(path)
        part = unseal(blob, f"{d}/{part_name}")
        if part["step"] != step or part["world_size"] != world_size:
            raise CorruptCheckpointError(f"{d}/{part_name} belongs to step {part['step']} / world {part['world_size']}")
        if part.get("cursor") is not None:
            cursor.update(DataCursor.from_json(part["cursor"]))
        if part.get("cut_id") is not None:
            cut_ids.add(int(part["cut_id"]))
        parts[str(rank)] = {
            "part": part_name,
            "part_checksum": checksum(blob),
            "tensors": tensors_name,
            "tensors_checksum": part["tensors_checksum"],
            "tensors_bytes": part["tensors_bytes"],
        }
    if len(cut_ids) > 1:
        # Parts of different cuts: not one checkpoint (a rank re-saved this step after a restore and the others
        # have not yet). Published once every rank's part carries the same cut; say so, never silently.
        log.warning("%s: parts carry cuts %s, not one: the manifest waits until every rank saves this step's cut",
                    d, sorted(cut_ids))  # fmt: skip
        return None
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "parts": parts,
        "cursor": cursor.to_json(),
        "cut_ids": sorted(cut_ids),
        "lineage": lineage_of(cursor),  # what the model learned from, readable (the cursor stays what restores read)
    }
    return sealed(manifest)


def read_manifest(storage: Storage, step: int) -> dict[str, Any]:
    """Step ``step``'s manifest, verified; :class:`CorruptCheckpointError` if it is missing, corrupt or of another
    step or format.
    """
    path = storage.join(step_dir(step), MANIFEST)
    try:
        blob = storage.read(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{step_dir(step)} has no manifest (partial checkpoint)") from exc
    manifest = unseal(blob, f"{step_dir(step)}/{MANIFEST}")
    if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
        raise CorruptCheckpointError(
            f"{step_dir(step)}/{MANIFEST} has format {manifest.get('format')} step {manifest.get('step')}"
        )
    return manifest


def read_part(storage: Storage, manifest: dict[str, Any], part_rank: int) -> tuple[dict[str, Any], Any, DataCursor]:
    """Verify and load one part of a checkpoint: (part document, state, manifest cursor)."""
    step = int(manifest["step"])
    d = step_dir(step)
    entry = manifest["parts"].get(str(part_rank))
    if entry is None:
        raise CorruptCheckpointError(f"{d} has no part for rank {part_rank} (world size {manifest['world_size']})")
    part_blob = storage.read(storage.join(d, entry["part"]))
    if checksum(part_blob, entry["part_checksum"].split(":", 1)[0]) != entry["part_checksum"]:
        raise CorruptCheckpointError(f"{d}/{entry['part']} fails its checksum")
    part = unseal(part_blob, f"{d}/{entry['part']}")
    data = storage.read(storage.join(d, entry["tensors"]))
    algo = entry["tensors_checksum"].split(":", 1)[0]
    if len(data) != entry["tensors_bytes"] or checksum(data, algo) != entry["tensors_checksum"]:
        raise CorruptCheckpointError(f"{d}/{entry['tensors']} fails its checksum or size")
    table, base = parse_safetensors(data)
    rows = part["tensors"]

    def make(i: int) -> Any:
        info = table.get(f"t{i}")
        row = rows[i]
        if info is None or info["dtype"] != row["dtype"] or list(info["shape"]) != list(row["shape"]):
            raise CorruptCheckpointError(f"{d}/{entry['tensors']}: tensor t{i} does not match its part table")
        return make_tensor(row["kind"], row["dtype"], row["shape"], data, base + int(info["data_offsets"][0]))

    try:
        state = unflatten(part["skeleton"], make)
        cursor = DataCursor.from_json(manifest["cursor"])
    except (ValueError, KeyError, CursorError) as exc:
        raise CorruptCheckpointError(f"{d}: malformed part or cursor: {exc}") from exc
    return part, state, cursor
