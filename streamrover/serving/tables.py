"""Embedding tables across versions: touched-row tracking while training, delta files, and the reader.

**Tracking** (:class:`RowTracker`, torch): a forward pre-hook on each tracked ``nn.Embedding`` /
``nn.EmbeddingBag`` keeps a reference to the index tensor it looks up (no copy, no torch op: the hook is the
only per-step cost); :meth:`RowTracker.step_done` only marks where the step ends. Before each checkpoint
(:meth:`RowTracker.state`, :meth:`RowTracker.sync`) the indices of every step done since the last checkpoint
are joined per table and stamped in one ``index_fill_`` (``touched[row] = step``: one int64 per row, never a
diff of the table). A row gets the step of the checkpoint after its lookup rather than of the lookup itself;
against versions, which are checkpoint steps, the two compare alike. The stamps travel in every checkpoint
(``extra["streamrover_touched"]``), so a delta against version P is exactly the rows whose stamp is above P,
whatever checkpoints were skipped or restored in between. With several ranks the stamps are merged
(all-reduce MAX) before each checkpoint: any rank's lookup changes the row everywhere. An index tensor
changed in place between its lookup and the next checkpoint (a reused input buffer) is refused with
:class:`~streamrover.serving.api.ServingError` at that checkpoint: its rows would be lost.

Which optimizers this is exact for: a looked-up row is the only row a step changes when the table's
optimizer leaves rows with a zero gradient alone: SGD without momentum or weight decay, Adagrad without
weight decay, SparseAdam, or any optimizer on sparse gradients (``sparse=True``). Adam, RMSprop or momentum on
dense gradients keep moving a row after its last lookup (its moments decay but stay non-zero), though never a
row no step has looked up: ``RowTracker(model, sticky=True)`` stamps every row ever looked up with the step of
each checkpoint, which is exact for them too, at the price of deltas that hold every row seen so far. Weight
decay moves every row: :meth:`RowTracker.check_optimizer` refuses it, and the others without ``sticky``.

**Reading** (:func:`read_tables`, numpy only: a server needs no torch): version N's tables are its base's
tables, then each delta of the chain from the base up to N applied in order (``table[rows] = values``). The
chain is followed from N back through each delta's ``parent``: a delta of a retired timeline is never on it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from streamrover.serving.api import BASE, DELTA, DELTA_FILE, FULL, TABLES_FILE, BrokenChainError, ServingError
from streamrover.serving.repository import ModelRepository

TOUCHED_KEY = "streamrover_touched"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


# -- safetensors, numpy only -------------------------------------------------------------
def dump_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as a safetensors file (any safetensors reader opens it)."""
    table: dict[str, Any] = {"__metadata__": {"format": "streamrover-serving"}}
    blobs, pos = [], 0
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        if arr.dtype not in _NAMES:
            raise ServingError(f"table {name!r} has dtype {arr.dtype}, which a version file cannot hold")
        data = arr.tobytes()
        table[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def load_arrays(blob: bytes) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file (copies: writable, independent of ``blob``)."""
    n = int.from_bytes(blob[:8], "little")
    if len(blob) < 8 or 8 + n > len(blob):
        raise ServingError("a version's tables file is truncated (header runs past its end)")
    table = json.loads(blob[8 : 8 + n])
    out = {}
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        arr: np.ndarray = np.frombuffer(blob, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=8 + n + begin)
        out[name] = arr.reshape(entry["shape"]).copy()
    return out


# -- base and delta ------------------------------------------------------------------------
def delta_arrays(
    tables: dict[str, np.ndarray], touched: dict[str, np.ndarray], parent_step: int
) -> dict[str, np.ndarray]:
    """The delta over version ``parent_step``: for each table, the rows stamped after it and their values."""
    out: dict[str, np.ndarray] = {}
    for name, table in tables.items():
        stamps = touched.get(name)
        if stamps is None or len(stamps) != len(table):
            raise ServingError(f"table {name!r} has no touched-row stamps of its size in the checkpoint: "
                               "attach a RowTracker to the model before training")  # fmt: skip
        rows = np.nonzero(stamps > parent_step)[0].astype(np.int64)
        out[f"{name}.rows"] = rows
        out[f"{name}.values"] = table[rows]
    return out


def apply_delta(tables: dict[str, np.ndarray], delta: dict[str, np.ndarray]) -> None:
    """Apply a delta in place: ``table[rows] = values`` for each table it names."""
    for key, rows in delta.items():
        if not key.endswith(".rows"):
            continue
        name = key[: -len(".rows")]
        if name not in tables:
            raise ServingError(f"a delta names table {name!r}, which its base does not hold")
        tables[name][rows] = delta[f"{name}.values"]


def read_tables(repo: ModelRepository, version: int) -> dict[str, np.ndarray]:
    """Version ``version``'s tables, rebuilt from its base and the deltas of its chain (see the module docstring)."""
    chain = repo.chain(version)
    if chain[0].kind == FULL:
        return {}
    if chain[0].kind != BASE:
        raise BrokenChainError(f"{repo.name}: version {version}'s chain starts at {chain[0].version}, a "
                               f"{chain[0].kind!r}, not a base")  # fmt: skip
    tables = load_arrays(repo.read(chain[0].version, TABLES_FILE))
    for info in chain[1:]:
        if info.kind != DELTA:
            raise BrokenChainError(f"{repo.name}: version {info.version} on {version}'s chain is a {info.kind}")
        apply_delta(tables, load_arrays(repo.read(info.version, DELTA_FILE)))
    return tables


# -- tracking (torch) ------------------------------------------------------------------------
class RowTracker:
    """Stamps the rows of a model's embedding tables with the step that last looked them up.

    ``tables``: names of ``nn.Embedding``/``nn.EmbeddingBag`` submodules of ``model`` (default: all of them).
    The tracked parameters are named ``<module>.weight`` relative to ``model``: ``model`` is the module
    that is served (the exporter's model factory builds the same module). ``sticky``: a row once looked up
    counts as changed at every checkpoint (for optimizers with moments on dense gradients: module docstring).
    """

    #: Lookups held before step_done stamps them anyway (bounds memory between far-apart checkpoints).
    MAX_PENDING = 4096

    def __init__(self, model: Any, tables: list[str] | None = None, *, sticky: bool = False) -> None:
        import torch
        from torch import nn

        kinds = (nn.Embedding, nn.EmbeddingBag)
        modules = dict(model.named_modules())
        names = tables if tables is not None else [n for n, m in modules.items() if isinstance(m, kinds)]
        if not names:
            raise ServingError("RowTracker: the model has no nn.Embedding or nn.EmbeddingBag to track")
        self.sticky = sticky
        self.last_step = 0
        # (table's first row in _flat, index tensor, its version counter) per lookup, in order; the first _done
        # of them were made by steps already done (step_done), the rest by the step under way
        self._pending: list[tuple[int, Any, int]] = []
        self._done = 0
        self.touched: dict[str, Any] = {}  # per table: a view of _flat
        self._hooks = []
        offsets: dict[str, tuple[int, int]] = {}
        for name in names:
            module = modules.get(name)
            if not isinstance(module, kinds):
                raise ServingError(f"RowTracker: {name!r} is not an nn.Embedding/nn.EmbeddingBag of the model")
            first = sum(n for _, n in offsets.values())
            offsets[f"{name}.weight"] = (first, int(module.weight.shape[0]))
            self._hooks.append(module.register_forward_pre_hook(self._hook(first)))
        # every table's stamps in one tensor: a checkpoint stamps the lookups of all tables in one index_fill_
        self._flat = torch.zeros(sum(n for _, n in offsets.values()), dtype=torch.int64)
        self._tables: dict[int, Any] = {}  # a table's first row in _flat -> its view
        for param, (first, n) in offsets.items():
            self.touched[param] = self._tables[first] = self._flat[first : first + n]

    def _hook(self, first: int) -> Any:
        pending = self._pending

        def record(module: Any, args: tuple[Any, ...]) -> None:
            index = args[0]
            try:
                pending.append((first, index, index._version))
            except RuntimeError:  # an inference-mode tensor has no version counter (and a lookup there trains nothing)
                pending.append((first, index, -1))

        return record

    @property
    def params(self) -> list[str]:
        """The tracked parameter names (``<module>.weight``)."""
        return list(self.touched)

    def step_done(self, step: int) -> None:
        """The lookups since the last call were ``step``'s (call after ``optimizer.step()``)."""
        self.last_step = step
        self._done = len(self._pending)
        if self._done > self.MAX_PENDING:
            self._stamp()

    def _stamp(self) -> None:
        """Stamp the rows of the steps done with the last step done (see the module docstring): per table, one
        ``cat`` of the index tensors it saw and one ``index_fill_``."""
        import torch

        done, self._pending[: self._done] = self._pending[: self._done], []
        self._done = 0
        by_table: dict[int, list[Any]] = {}
        for first, index, version in done:
            if version >= 0 and index._version != version:
                raise ServingError("RowTracker: an index tensor looked up in a tracked table was changed in place "
                                   "after the lookup, before the checkpoint: its rows are unknown. Give the model "
                                   "a fresh tensor each step (not a reused buffer)")  # fmt: skip
            by_table.setdefault(first, []).append(index)
        for first, indices in by_table.items():
            try:
                rows = torch.cat(indices) if len(indices) > 1 else indices[0]  # one cat: no reshape of each
            except RuntimeError:  # lookups of different shapes
                rows = torch.cat([i.reshape(-1) for i in indices])
            # repeated rows are filled with the same step: no torch.unique (a sort)
            self._tables[first].index_fill_(0, rows.reshape(-1).to("cpu", torch.int64), self.last_step)

    def sync(self) -> None:
        """Merge every rank's stamps (all-reduce MAX; a collective: call it on every rank before a checkpoint)."""
        import torch.distributed as dist

        self._stamp()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self._flat, op=dist.ReduceOp.MAX)  # every table at once

    def state(self) -> dict[str, Any]:
        """The stamps, for a checkpoint's ``extra[TOUCHED_KEY]`` (sticky: every row ever looked up at the last step)."""
        self._stamp()
        if self.sticky:
            self._flat[self._flat > 0] = self.last_step
        return {k: v.clone() for k, v in self.touched.items()}

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Restore the stamps of a checkpoint (absent: every row counts as touched at step 0)."""
        for param, stamps in self.touched.items():
            loaded = (state or {}).get(param)
            if loaded is None:
                stamps.zero_()
            else:
                stamps.copy_(loaded)
        self._pending.clear()  # lookups of the abandoned timeline
        self._done = 0

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse an optimizer that moves rows the stamps would miss (see the module docstring)."""
        import torch

        for group in optimizer.param_groups:
            if group.get("weight_decay", 0):
                raise ServingError("RowTracker: weight decay changes every row each step; deltas would miss rows. "
                                   "Use weight_decay=0 for the embedding tables' parameter group")  # fmt: skip
        if self.sticky:
            return
        if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
            raise ServingError("RowTracker: SGD with momentum keeps moving rows after their last lookup; use "
                               "momentum=0 for the tables, or RowTracker(sticky=True)")  # fmt: skip
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adamax)):
            raise ServingError(f"RowTracker: {type(optimizer).__name__} on dense gradients keeps moving rows after "
                               "their last lookup; use RowTracker(sticky=True) (deltas then hold every row seen), or "
                               "give the tables a SparseAdam (nn.Embedding(sparse=True)) or Adagrad")  # fmt: skip

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


__all__ = ["TOUCHED_KEY", "RowTracker", "apply_delta", "delta_arrays", "dump_arrays", "load_arrays", "read_tables"]
