"""PyTorch adapters: model + optimizer for data-parallel training (one copy or every rank), and FSDP shards.

Torch is imported when these functions run, never at package import. Loading copies
tensors into the live model and optimizer, so a zero-copy load from shared memory is
safe: nothing keeps a view of the snapshot buffer afterwards.
"""

from __future__ import annotations

from typing import Any

from streamrover.ckpt.api import LoadedCheckpoint
from streamrover.ckpt.checkpointer import Checkpointer
from streamrover.cursor import DataCursor


def _unwrap(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel wrappers."""
    return model.module if type(model).__name__ in ("DistributedDataParallel", "DataParallel") else model


def _clone_tensors(node: Any) -> Any:
    import torch

    if isinstance(node, torch.Tensor):
        return node.clone()
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


def load_torch_state(state: dict[str, Any], model: Any, optimizer: Any | None = None) -> dict[str, Any]:
    """Copy ``state`` (from :func:`torch_state`) into ``model`` and ``optimizer``; return its ``extra``."""
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        # Optimizer.load_state_dict keeps the given tensors when dtype and device match: clone them,
        # or its state would alias the snapshot buffer that a later save overwrites.
        optimizer.load_state_dict(_clone_tensors(state["optimizer"]))
    extra: dict[str, Any] = state.get("extra") or {}
    return extra


class TorchCheckpoint:
    """Data-parallel model + optimizer checkpoints over a :class:`Checkpointer`.

    ``replicate=False`` (one copy): rank 0 saves the state, other ranks save an empty part
    (their cursor still joins the manifest), and every rank loads rank 0's part.
    ``replicate=True`` (every rank): each rank saves and loads its own full copy, so a rank
    restarting on its node reloads from its own shared memory.
    """

    def __init__(
        self, checkpointer: Checkpointer, model: Any, optimizer: Any | None = None, replicate: bool = False
    ) -> None:
        self.checkpointer = checkpointer
        self.model = model
        self.optimizer = optimizer
        self.replicate = replicate

    def _saves_state(self) -> bool:
        return self.replicate or self.checkpointer.rank == 0

    def save(
        self, step: int, *, extra: dict[str, Any] | None = None, persist: bool = True, cursor: DataCursor | None = None
    ) -> None:
        state = torch_state(self.model, self.optimizer, extra) if self._saves_state() else {}
        self.checkpointer.save(step, state, cursor=cursor, persist=persist)

    def load(self, *, restore: bool = True) -> tuple[LoadedCheckpoint, dict[str, Any]]:
        """Load the newest checkpoint into the model and optimizer; return it and its ``extra``."""
        part = self.checkpointer.rank if self.replicate else 0
        loaded = self.checkpointer.load(part=part, zero_copy=True, restore=restore)
        extra = load_torch_state(loaded.state, self.model, self.optimizer)
        loaded.state = {}  # drop the views of shared memory
        return loaded, extra


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
