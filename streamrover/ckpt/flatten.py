"""Nested state <-> (JSON skeleton, flat tensor list), and the dtype table shared with safetensors.

A state is a nested structure of dicts (str or int keys), lists, tuples, torch
tensors, numpy arrays and scalars, and JSON-able leaves (None, bool, int, float,
str, bytes). :func:`flatten` turns it into a skeleton (JSON, tensors replaced by
their index) and the list of tensors; :func:`unflatten` reverses it. Torch is never
imported here unless the state already holds torch tensors (then it is imported).
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrover.ckpt.api import UnsupportedStateError

# safetensors dtype name -> (numpy dtype name or None, torch dtype attribute or None, itemsize)
DTYPES: dict[str, tuple[str | None, str | None, int]] = {
    "F64": ("float64", "float64", 8),
    "F32": ("float32", "float32", 4),
    "F16": ("float16", "float16", 2),
    "BF16": (None, "bfloat16", 2),
    "I64": ("int64", "int64", 8),
    "I32": ("int32", "int32", 4),
    "I16": ("int16", "int16", 2),
    "I8": ("int8", "int8", 1),
    "U64": ("uint64", "uint64", 8),
    "U32": ("uint32", "uint32", 4),
    "U16": ("uint16", "uint16", 2),
    "U8": ("uint8", "uint8", 1),
    "BOOL": ("bool", "bool", 1),
    "F8_E4M3": (None, "float8_e4m3fn", 1),
    "F8_E5M2": (None, "float8_e5m2", 1),
    "C64": ("complex64", "complex64", 8),
}
_NUMPY_TO_ST = {np_name: st for st, (np_name, _, _) in DTYPES.items() if np_name}
_TORCH_TO_ST = {t_name: st for st, (_, t_name, _) in DTYPES.items() if t_name}


@dataclass
class TensorEntry:
    """One tensor leaf of a flattened state."""

    kind: str  # "torch" | "numpy"
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    nbytes: int
    value: Any  # the torch.Tensor or np.ndarray (None once read back from a header)

    def table_row(self, offset: int) -> dict[str, Any]:
        """The entry's row of a part's tensor table: kind, dtype, shape, ``offset`` and size in bytes."""
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": offset,
            "nbytes": self.nbytes,
        }


def _is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def torch_dtype_name(value: Any) -> str:
    """The safetensors dtype name of a torch tensor, or a clear error."""
    name = str(value.dtype).removeprefix("torch.")
    try:
        return _TORCH_TO_ST[name]
    except KeyError:
        raise UnsupportedStateError(
            f"torch dtype {value.dtype} cannot be checkpointed (supported: {sorted(_TORCH_TO_ST)})"
        ) from None


def numpy_dtype_name(value: np.ndarray | np.generic) -> str:
    """The safetensors dtype name of a numpy value's dtype; :class:`UnsupportedStateError` when it has none."""
    try:
        return _NUMPY_TO_ST[value.dtype.name]
    except KeyError:
        raise UnsupportedStateError(
            f"numpy dtype {value.dtype} cannot be checkpointed (supported: {sorted(_NUMPY_TO_ST)})"
        ) from None


def _torch_entry(value: Any, path: str) -> TensorEntry:
    if type(value).__name__ == "DTensor" or value.layout.__repr__() != "torch.strided":
        raise UnsupportedStateError(
            f"{path}: {type(value).__name__} with layout {value.layout} is not a plain dense tensor; "
            "use streamrover.ckpt.fsdp_sharded_state() for FSDP/DTensor state"
        )
    dtype = torch_dtype_name(value)
    return TensorEntry("torch", dtype, tuple(value.shape), value.numel() * value.element_size(), value)


def flatten(state: Any) -> tuple[Any, list[TensorEntry]]:
    """Split ``state`` into a JSON-able skeleton and its tensors, in a deterministic order."""
    tensors: list[TensorEntry] = []

    def walk(node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, str)):
            return {"v": node}
        if isinstance(node, (int, float)) and not isinstance(node, np.generic):
            return {"v": node}
        if _is_torch_tensor(node):
            tensors.append(_torch_entry(node, path))
            return {"t": len(tensors) - 1}
        if isinstance(node, np.ndarray):
            tensors.append(TensorEntry("numpy", numpy_dtype_name(node), tuple(node.shape), int(node.nbytes), node))
            return {"t": len(tensors) - 1}
        if isinstance(node, np.generic):
            arr = np.asarray(node)
            tensors.append(TensorEntry("numpy", numpy_dtype_name(arr), (), int(arr.nbytes), arr))
            return {"s": len(tensors) - 1}
        if isinstance(node, bytes):
            return {"b": base64.b64encode(node).decode("ascii")}
        if isinstance(node, dict):
            items = []
            for key, child in node.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise UnsupportedStateError(f"{path}: dict key {key!r} is not a str or int")
                items.append([key, walk(child, f"{path}.{key}" if path else str(key))])
            return {"d": items}
        if isinstance(node, list):
            return {"l": [walk(c, f"{path}[{i}]") for i, c in enumerate(node)]}
        if isinstance(node, tuple):
            return {"u": [walk(c, f"{path}[{i}]") for i, c in enumerate(node)]}
        raise UnsupportedStateError(
            f"{path or '<root>'}: a {type(node).__module__}.{type(node).__qualname__} cannot be checkpointed; "
            "use tensors, numpy arrays, dicts, lists, tuples and JSON scalars"
        )

    return walk(state, ""), tensors


def unflatten(skeleton: Any, make_tensor: Callable[[int], Any]) -> Any:
    """Rebuild the nested state; ``make_tensor(i)`` returns tensor ``i`` of the table."""

    def walk(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"malformed state skeleton node {node!r}")
        ((tag, body),) = node.items()
        if tag == "v":
            return body
        if tag == "t":
            return make_tensor(int(body))
        if tag == "s":
            return make_tensor(int(body))[()]
        if tag == "b":
            return base64.b64decode(body)
        if tag == "d":
            return {key: walk(child) for key, child in body}
        if tag == "l":
            return [walk(c) for c in body]
        if tag == "u":
            return tuple(walk(c) for c in body)
        raise ValueError(f"unknown state skeleton tag {tag!r}")

    return walk(skeleton)


def make_tensor(kind: str, dtype: str, shape: list[int] | tuple[int, ...], buffer: Any, offset: int) -> Any:
    """A tensor viewing ``buffer[offset:]`` (zero-copy) of the given safetensors dtype and shape.

    ``buffer`` is any object with the buffer protocol (mmap, bytearray, memoryview).
    Never unpickles: the bytes are reinterpreted, nothing is executed.
    """
    try:
        np_name, torch_name, _ = DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown tensor dtype {dtype!r}") from None
    count = 1
    for dim in shape:
        count *= int(dim)
    if kind == "numpy":
        if np_name is None:
            raise ValueError(f"dtype {dtype} has no numpy equivalent")
        return np.frombuffer(buffer, dtype=np_name, count=count, offset=offset).reshape(shape)
    if kind != "torch":
        raise ValueError(f"unknown tensor kind {kind!r}")
    import torch

    tdtype = getattr(torch, str(torch_name))
    if count == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    # torch.frombuffer warns on read-only buffers; all buffers handed here are writable.
    return torch.frombuffer(buffer, dtype=tdtype, count=count, offset=offset).view(tuple(shape))


def copy_into(entry: TensorEntry, buffer: Any, offset: int) -> None:
    """Copy ``entry.value`` into ``buffer[offset:offset + nbytes]`` (any layout, any device)."""
    if entry.nbytes == 0:
        return
    if entry.kind == "numpy":
        dst = np.frombuffer(buffer, dtype=np.uint8, count=entry.nbytes, offset=offset)
        src = np.ascontiguousarray(entry.value)
        dst[:] = src.reshape(-1).view(np.uint8)
        return
    import torch

    value = entry.value
    dst_t = torch.frombuffer(buffer, dtype=value.dtype, count=value.numel(), offset=offset).view(value.shape)
    with torch.no_grad():
        dst_t.copy_(value.detach())
