"""PyTorch adapters: model + optimizer for data-parallel training (one copy or every rank), and FSDP shards.

Torch is imported when these functions run, never at package import. Loading copies
tensors into the live model and optimizer, so a zero-copy load from shared memory is
safe: nothing keeps a view of the snapshot buffer afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from streamrover.ckpt.api import LoadedCheckpoint
from streamrover.ckpt.checkpointer import Checkpointer
from streamrover.ckpt.copier import copy_from_mapping
from streamrover.cursor import DataCursor


def _unwrap(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel wrappers."""
    return model.module if type(model).__name__ in ("DistributedDataParallel", "DataParallel") else model


def _clone_tensors(node: Any) -> Any:
    """``node`` with every torch tensor and numpy array copied (a snapshot's views of shared memory included)."""
    import numpy as np
    import torch

    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, np.ndarray):
        return node.copy()
    if isinstance(node, dict):
        return {k: _clone_tensors(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_clone_tensors(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_clone_tensors(v) for v in node)
    return node


def torch_state(model: Any, optimizer: Any | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ..., "extra": ...}`` of a (possibly DDP-wrapped) model."""
    state: dict[str, Any] = {"model": _unwrap(model).state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if extra is not None:
        state["extra"] = extra
    return state


def _plain_targets(module: Any) -> dict[str, Any]:
    """The parameters and persistent buffers of ``module`` whose loading is ``Module._load_from_state_dict``'s plain
    ``copy_``: neither their module nor any module above it overrides it or has a load pre-hook, which may rename,
    transform or skip entries."""
    import torch

    plain_load = torch.nn.Module._load_from_state_dict
    custom: list[str] = []  # prefixes of the modules whose subtree loads its own way
    targets: dict[str, Any] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(c) for c in custom):
            continue
        if type(sub)._load_from_state_dict is not plain_load or sub._load_state_dict_pre_hooks:
            custom.append(prefix)
            continue
        for key, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is not None and key not in sub._non_persistent_buffers_set:
                targets[prefix + key] = t
    return targets


def _raw_copyable(dst: Any, src: Any) -> bool:
    """Whether the bytes of CPU tensor ``src`` are what ``dst.copy_(src)`` would write into ``dst``."""
    import torch

    return (
        type(src) is torch.Tensor
        and type(dst) in (torch.Tensor, torch.nn.Parameter)
        and dst.device.type == src.device.type == "cpu"
        and dst.layout == src.layout == torch.strided
        and dst.dtype == src.dtype
        and not dst.is_quantized
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and not (dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg())
        and dst.numel() > 0
    )


def load_module_state(module: Any, state: Mapping[str, Any], strict: bool = True) -> Any:
    """``module.load_state_dict(state, strict)``, with the bytes copied out of a snapshot at memory speed.

    Each CPU tensor of ``state`` that a parameter or buffer would take with a plain ``copy_`` (same dtype and
    shape, both contiguous, loaded by ``Module``'s own ``_load_from_state_dict`` with no pre-hook) is copied
    first, in the state's order, by :func:`~streamrover.ckpt.copier.copy_from_mapping` (non-temporal stores,
    the page faults of a fresh mapping taken ahead on another core); ``load_state_dict`` is then given the
    parameter itself for it, whose ``copy_`` onto itself is a no-op. Everything else (the key check, hooks,
    GPU tensors, other dtypes, the returned missing and unexpected keys) is ``load_state_dict``'s own.
    """
    import collections

    import torch

    targets = _plain_targets(module)
    ranges: list[tuple[int, int, int]] = []
    copied: dict[str, Any] = {}
    for key, src in state.items():
        dst = targets.get(key)
        if dst is not None and _raw_copyable(dst, src):
            ranges.append((dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()))
            copied[key] = dst
    if copied:
        copy_from_mapping(ranges)
        torch.autograd.graph.increment_version(list(copied.values()))  # as copy_ would: autograd sees the write
        given = state
        state = collections.OrderedDict((k, copied.get(k, v)) for k, v in state.items())
        metadata = getattr(given, "_metadata", None)
        if metadata is not None:
            state._metadata = metadata  # type: ignore[attr-defined]
    return module.load_state_dict(state, strict=strict)


def load_torch_state(state: dict[str, Any], model: Any, optimizer: Any | None = None) -> dict[str, Any]:
    """Copy ``state`` (from :func:`torch_state`) into ``model`` (:func:`load_module_state`) and ``optimizer``;
    return its ``extra``."""
    load_module_state(_unwrap(model), state["model"])
    if optimizer is not None and "optimizer" in state:
        # Optimizer.load_state_dict keeps the given tensors when dtype and device match: clone them,
        # or its state would alias the snapshot buffer that a later save overwrites.
        optimizer.load_state_dict(_clone_tensors(state["optimizer"]))
    extra: dict[str, Any] = state.get("extra") or {}
    return extra


def _storage_ptr(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


def optimizer_owned(optimizer: Any) -> Callable[[Any], bool]:
    """A predicate: does a tensor share memory with a parameter of ``optimizer`` or with its state?

    Those tensors are changed only by ``optimizer.step()`` in an ordinary training loop, so an overlapped
    save may copy them in the background until the next step (see :class:`TorchCheckpoint`).
    """
    import torch

    ptrs = {_storage_ptr(p) for group in optimizer.param_groups for p in group["params"]}
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                ptrs.add(_storage_ptr(value))
    ptrs.discard(0)  # empty storages all have address 0
    return lambda t: _storage_ptr(t) in ptrs


class TorchCheckpoint:
    """Data-parallel model + optimizer checkpoints over a :class:`Checkpointer`.

    ``replicate=False`` (one copy): rank 0 saves the state, other ranks save an empty part
    (their cursor still joins the manifest), and every rank loads rank 0's part.
    ``replicate=True`` (every rank): each rank saves and loads its own full copy, so a rank
    restarting on its node reloads from its own shared memory.

    ``overlap=True`` (pipelined snapshots, as CheckFreq does): :meth:`save` copies the optimizer's
    parameters and state into shared memory on a background thread and returns; the next
    forward and backward passes run during that copy. An optimizer step pre-hook
    (``Optimizer.register_step_pre_hook``) makes ``optimizer.step()`` wait for the copy first, so
    the snapshot holds exactly the state at the time of the save. The snapshot becomes visible
    (to a restarted trainer and to the saver) only once its copy is complete.

    What is copied before :meth:`save` returns: everything that is not a parameter of the
    optimizer or a tensor of its state: module buffers (BatchNorm running statistics, which
    forward passes update), parameters the optimizer does not own, ``extra``, and tensors that
    are not contiguous host memory (GPU tensors). The caller may do anything with those.

    Until the next ``optimizer.step()`` (or :meth:`wait`, or the next save/load), the caller must
    not change the optimizer's parameters or state other than through ``optimizer.step()``: no
    in-place writes to ``param.data``, no ``load_state_dict`` into the model or the optimizer
    from outside this class, no ``model.to(...)``, no second optimizer stepping the same
    parameters. Forward, backward, ``zero_grad``, gradient clipping and unscaling (they write
    gradients, not parameters) and LR scheduler steps (they write ``param_groups`` numbers, which
    are copied before return) are fine. Call :meth:`close` (or :meth:`wait`) when training stops
    without another step.

    A failure of the background copy is raised (as :class:`SnapshotCopyError`) by the next
    ``optimizer.step()``, save, load or :meth:`wait`; that snapshot is then never published.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        model: Any,
        optimizer: Any | None = None,
        replicate: bool = False,
        *,
        overlap: bool = False,
    ) -> None:
        if overlap and optimizer is None:
            raise ValueError(
                "overlap=True needs the optimizer: its step pre-hook is what keeps the parameters unchanged "
                "until their background copy is done"
            )
        self.checkpointer = checkpointer
        self.model = model
        self.optimizer = optimizer
        self.replicate = replicate
        self.overlap = overlap
        self._hook: Any = None
        if optimizer is not None and overlap:
            self._hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.checkpointer.wait_snapshot()

    def _saves_state(self) -> bool:
        return self.replicate or self.checkpointer.rank == 0

    def save(
        self,
        step: int,
        *,
        extra: dict[str, Any] | None = None,
        persist: bool = True,
        cursor: DataCursor | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Snapshot the model and optimizer at ``step`` (see the class docstring for ``overlap``); ``meta`` (JSON)
        goes into the part document (what the trainer reported, for a serving export's lineage)."""
        if not self._saves_state():
            self.checkpointer.save(step, {}, cursor=cursor, persist=persist, meta=meta)
            return
        state = torch_state(self.model, self.optimizer, extra)
        defer = optimizer_owned(self.optimizer) if self.overlap else None
        self.checkpointer.save(step, state, cursor=cursor, persist=persist, defer=defer, meta=meta)

    def wait(self) -> None:
        """Wait until the last save's snapshot is complete (a no-op without ``overlap``)."""
        self.checkpointer.wait_snapshot()

    def load(self, *, restore: bool = True) -> tuple[LoadedCheckpoint, dict[str, Any]]:
        """Load the newest checkpoint into the model and optimizer; return it and its ``extra``."""
        part = self.checkpointer.rank if self.replicate else 0
        loaded = self.checkpointer.load(part=part, zero_copy=True, restore=restore)
        extra = load_torch_state(loaded.state, self.model, self.optimizer)
        loaded.state = {}  # drop the views of shared memory
        return loaded, extra

    def close(self) -> None:
        """Finish the last snapshot's copy and remove the step hook (the checkpointer stays open)."""
        try:
            self.checkpointer.wait_snapshot()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None


# -- FSDP / DTensor sharded state -------------------------------------------------------------
def _to_local(node: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(node, DTensor):
        return node.to_local()
    if isinstance(node, dict):
        return {k: _to_local(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_to_local(v) for v in node]
    return node


def _from_local(template: Any, loaded: Any) -> Any:
    """``loaded`` (local shards) rebuilt as DTensors wherever ``template`` holds one."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(template, DTensor):
        local = loaded.clone().to(template.to_local().device)
        return DTensor.from_local(
            local, template.device_mesh, template.placements, shape=template.shape, stride=template.stride()
        )
    if isinstance(template, torch.Tensor):
        return loaded.clone()
    if isinstance(template, dict):
        return {k: _from_local(template[k], loaded[k]) if k in template else loaded[k] for k in loaded}
    if isinstance(template, list):
        return [_from_local(t, v) for t, v in zip(template, loaded)]
    return loaded


def fsdp_sharded_state(model: Any, optimizer: Any | None = None) -> dict[str, Any]:
    """This rank's shard of an FSDP (or any DTensor-parallel) model and optimizer, as plain local tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": _to_local(model_sd)}
    if optimizer is not None:
        state["optimizer"] = _to_local(optim_sd)
    return state


def load_fsdp_sharded_state(state: dict[str, Any], model: Any, optimizer: Any | None = None) -> None:
    """Load this rank's shard (from :func:`fsdp_sharded_state`) back; the sharding must be the same."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    new_model = _from_local(model_sd, state["model"])
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=new_model, optim_state_dict={})
        return
    new_optim = _from_local(optim_sd, state["optimizer"])
    set_state_dict(model, optimizer, model_state_dict=new_model, optim_state_dict=new_optim)
