"""Restore into existing tensors: a snapshot's bytes read straight into the model's (and optimizer's) tensors.

A restarted trainer has built its model before it loads; copying a checkpoint into it through a fresh
mapping of the snapshot buffer pays a page fault per page mapped, then the copy. ``pread`` from the
buffer's ``/dev/shm`` file into the tensors does one copy in the kernel and maps nothing (on a VM, where
page-table updates are dear, about 1.7x less CPU), on two threads (:class:`~streamrover.ckpt.copier.CopyJob`).

A tensor of the checkpoint is read into the tensor at the same place of ``into`` (same dict keys, list
positions) when that is a contiguous CPU torch tensor of the same dtype and shape; every other one is a
private copy, as with ``load(zero_copy=False)``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

from streamrover.ckpt.api import CheckpointError
from streamrover.ckpt.copier import CopyJob
from streamrover.ckpt.flatten import _is_torch_tensor, torch_dtype_name, unflatten

HELPER_FROM_BYTES = 16 << 20  # below this, one thread reads (a helper's start costs more than it saves)


def file_reader(fd: int) -> Callable[[int, int, int], None]:
    """A chunk copy that reads ``n`` bytes at offset ``src`` of file ``fd`` into address ``dst`` (``pread``)."""

    def read(dst: int, src: int, n: int) -> None:
        done = 0
        while done < n:
            view = memoryview((ctypes.c_char * (n - done)).from_address(dst + done)).cast("B")
            got = os.preadv(fd, [view], src + done)
            if got == 0:
                raise CheckpointError(f"snapshot file ends at {src + done}, {n - done} bytes short")
            done += got

    return read


def targets(skeleton: Any, rows: list[dict[str, Any]], into: Any) -> dict[int, Any]:
    """Tensor index of the snapshot -> the tensor of ``into`` at the same place that can receive its bytes."""
    found: dict[int, Any] = {}

    def walk(node: Any, target: Any) -> None:
        ((tag, body),) = node.items()
        if tag == "t":
            row = rows[int(body)]
            if _receives(target, row):
                found[int(body)] = target
        elif tag == "d" and isinstance(target, dict):
            for key, child in body:
                if key in target:
                    walk(child, target[key])
        elif tag in ("l", "u") and isinstance(target, (list, tuple)) and len(target) == len(body):
            for child, t in zip(body, target):
                walk(child, t)

    walk(skeleton, into)
    return found


def _receives(target: Any, row: dict[str, Any]) -> bool:
    if row["kind"] != "torch" or not _is_torch_tensor(target) or int(row["nbytes"]) == 0:
        return False
    if target.device.type != "cpu" or not target.is_contiguous() or target.is_conj() or target.is_neg():
        return False
    try:
        dtype = torch_dtype_name(target)
    except Exception:  # a dtype checkpoints do not hold
        return False
    return dtype == row["dtype"] and list(target.shape) == list(row["shape"])


def read_into(path: str, header: dict[str, Any], into: Any, make_copy: Callable[[int], Any]) -> Any:
    """The state of snapshot ``header`` in file ``path``: tensors matching ``into`` read into it, others by
    ``make_copy(i)``."""
    rows = header["tensors"]
    found = targets(header["skeleton"], rows, into)
    ranges = [(int(t.data_ptr()), int(rows[i]["offset"]), int(rows[i]["nbytes"])) for i, t in found.items()]
    if ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            job = CopyJob(ranges, list(found.values()), copy=file_reader(fd))
            job.start(1 if job.nbytes >= HELPER_FROM_BYTES else 0, name="ckpt-restore")
            job.wait()
        finally:
            os.close(fd)
    return unflatten(header["skeleton"], lambda i: found[i] if i in found else make_copy(i))


def copy_matching(state: Any, into: Any) -> Any:
    """``state`` with each tensor that has a receiving tensor at the same place of ``into`` copied into it."""
    if _is_torch_tensor(state) and _is_torch_tensor(into):
        same = into.dtype == state.dtype and into.shape == state.shape
        if same and into.device.type == "cpu" and into.is_contiguous():  # the targets read_into fills
            import torch

            with torch.no_grad():
                into.copy_(state)
            return into
        return state
    if isinstance(state, dict) and isinstance(into, dict):
        return {k: copy_matching(v, into[k]) if k in into else v for k, v in state.items()}
    if isinstance(state, (list, tuple)) and isinstance(into, (list, tuple)) and len(state) == len(into):
        out = [copy_matching(v, t) for v, t in zip(state, into)]
        return tuple(out) if isinstance(state, tuple) else out
    return state
