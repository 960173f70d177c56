"""PyTorch adapters: model + optimizer round trips, DDP (one copy / every rank) and FSDP2 shards on CPU with gloo."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrover.ckpt import Checkpointer, LoadedFrom, namespace_for
from streamrover.ckpt.layout import part_names, step_dir
from streamrover.ckpt.torch_adapter import (
    TorchCheckpoint,
    fsdp_sharded_state,
    load_fsdp_sharded_state,
    load_torch_state,
)

from .conftest import SHM, shm_names

pytestmark = pytest.mark.timeout(300)


def make_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(5, 6, generator=gen)).pow(2).sum().backward()
        optim.step()


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("from_memory", [True, False])
def test_resumed_training_matches_uninterrupted_training(root: str, from_memory: bool) -> None:
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optim, 3, seed=1)
    with Checkpointer(root, saver="thread") as ckpt:
        TorchCheckpoint(ckpt, model, optim).save(3, extra={"epoch": 2})
        ckpt.wait(timeout=60)
        train(model, optim, 4, seed=2)  # the uninterrupted run
        expected = params(model)
        model2 = make_model(seed=7)
        optim2 = torch.optim.Adam(model2.parameters(), lr=0.01)
        if from_memory:
            loaded, extra = TorchCheckpoint(ckpt, model2, optim2).load()
        else:
            loaded = ckpt.load(memory=False)
            extra = load_torch_state(loaded.state, model2, optim2)
        assert loaded.source == (LoadedFrom.MEMORY if from_memory else LoadedFrom.STORAGE)
        # later saves overwrite every buffer: the resumed model and optimizer must not alias shared memory
        for step in (4, 5):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}, persist=False)
        train(model2, optim2, 4, seed=2)
    assert extra == {"epoch": 2}
    for a, b in zip(expected, params(model2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _ddp_worker(rank: int, world: int, root: str, store: str, replicate: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, optim, 2, seed=rank)
        saved = params(model)
        ckpt = Checkpointer(root, rank=rank, world_size=world, saver="thread")
        adapter = TorchCheckpoint(ckpt, model, optim, replicate=replicate)
        adapter.save(2)
        ckpt.wait(timeout=60)
        dist.barrier()  # every part written (the last saver published the manifest)
        train(model, optim, 3, seed=5)
        # storage path: a new node would do this
        loaded = ckpt.load(memory=False, part=rank if replicate else 0)
        assert loaded.step == 2 and loaded.source == LoadedFrom.STORAGE
        info, _ = adapter.load()
        assert info.step == 2
        for a, b in zip(saved, params(model)):
            assert torch.equal(a, b), f"rank {rank}: parameters differ after load"
        assert optim.state_dict()["state"], "optimizer momentum was not restored"
        dist.barrier()
        ckpt.close(unlink=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("replicate", [False, True])
def test_ddp_two_ranks_one_copy_or_every_rank(root: str, tmp_path: Path, replicate: bool) -> None:
    mp.spawn(_ddp_worker, args=(2, root, str(tmp_path / "store"), replicate), nprocs=2)
    rank1 = Path(root) / step_dir(2) / part_names(1)[0]
    size0 = (Path(root) / step_dir(2) / part_names(0)[0]).stat().st_size
    if replicate:
        assert rank1.stat().st_size == size0
    else:
        assert rank1.stat().st_size < 200 < size0  # rank 1 wrote an empty part: header only
    assert shm_names(namespace_for(root)) == []


def _fsdp_worker(rank: int, world: int, root: str, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        train(model, optim, 2, seed=3)
        saved: dict[str, Any] = fsdp_sharded_state(model, optim)
        snapshot = {k: v.clone() for k, v in saved["model"].items()}
        with Checkpointer(root, rank=rank, world_size=world, saver="thread") as ckpt:
            ckpt.save(2, saved)
            ckpt.wait(timeout=60)
            train(model, optim, 2, seed=4)
            loaded = ckpt.load(zero_copy=True)
            assert loaded.source == LoadedFrom.MEMORY
            load_fsdp_sharded_state(loaded.state, model, optim)
            after = fsdp_sharded_state(model, optim)
            for key, value in snapshot.items():
                assert torch.equal(after["model"][key], value), f"rank {rank}: shard {key} differs"
            assert sorted(after["optimizer"]["state"]) == sorted(saved["optimizer"]["state"])
            ckpt.close(unlink=True)
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_state_each_rank_its_shard(root: str, tmp_path: Path) -> None:
    mp.spawn(_fsdp_worker, args=(2, root, str(tmp_path / "store")), nprocs=2)
    for rank in range(2):
        assert (Path(root) / step_dir(2) / part_names(rank)[0]).exists()
    assert not any(os.path.exists(os.path.join(SHM, n)) for n in shm_names(namespace_for(root)))


class _Scaled(torch.nn.Module):
    """A module that loads its own way: it halves the weight it is given (its own ``_load_from_state_dict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(5000))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        state_dict = {**state_dict, prefix + "weight": state_dict[prefix + "weight"] / 2}
        super()._load_from_state_dict(state_dict, prefix, *args)


def _mixed_model(seed: int) -> torch.nn.Module:
    """Plain parameters (one tied to another), batch-norm buffers (an int64 counter, a non-persistent buffer),
    a module with its own loading, one under a load pre-hook, and a bfloat16 layer."""
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.big = torch.nn.Linear(2048, 1024)  # 8 MiB of weights: the copy is large enough to be faulted ahead
    model.tied = torch.nn.Linear(1024, 2048, bias=False)
    model.tied.weight = torch.nn.Parameter(torch.randn(2048, 1024))
    model.tied2 = torch.nn.Linear(1024, 2048, bias=False)
    model.tied2.weight = model.tied.weight
    model.bn = torch.nn.BatchNorm1d(300)
    model.bn.register_buffer("scratch", torch.randn(10), persistent=False)
    model.scaled = _Scaled()
    model.hooked = torch.nn.Linear(40, 30)
    model.hooked.register_load_state_dict_pre_hook(
        lambda module, sd, prefix, *_: sd.__setitem__(prefix + "bias", sd[prefix + "bias"] + 1)
    )
    model.half = torch.nn.Linear(512, 512).to(torch.bfloat16)
    return model


def test_load_module_state_equals_load_state_dict_and_copies_the_plain_tensors_itself(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamrover.ckpt import copier, load_module_state

    copied: list[int] = []
    raw = copier._memmove
    monkeypatch.setattr(copier, "_memmove", lambda dst, src, n: (copied.append(n), raw(dst, src, n)))
    source = _mixed_model(seed=1)
    with torch.no_grad():
        source.bn.running_mean.uniform_()
        source.bn.num_batches_tracked.fill_(7)
    with Checkpointer(root, saver="thread") as ckpt:
        ckpt.save(1, source.state_dict(), persist=False)
        state = ckpt.load(zero_copy=True, restore=False).state  # views of the shared-memory buffer
        ours, theirs = _mixed_model(seed=2), _mixed_model(seed=2)
        versions = {k: p._version for k, p in ours.named_parameters()}
        result = load_module_state(ours, state)
        theirs.load_state_dict(state)
        del state
    assert result.missing_keys == result.unexpected_keys == []
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    for key in ours_state:
        torch.testing.assert_close(ours_state[key], theirs_state[key], rtol=0, atol=0, msg=key)
    assert ours.tied2.weight is ours.tied.weight  # still tied
    assert torch.equal(ours.scaled.weight, source.scaled.weight / 2)  # its own loading ran on the snapshot's bytes
    assert torch.equal(ours.hooked.bias, source.hooked.bias + 1)  # and the pre-hook
    own_way = ("scaled.", "hooked.", "bn.")  # batch norm has its own _load_from_state_dict too
    plain = [t for k, t in source.state_dict().items() if not k.startswith(own_way)]
    big = [t.numel() * t.element_size() for t in plain if t.numel() * t.element_size() >= copier.NT_FROM]
    assert sum(copied) == sum(t.numel() * t.element_size() for t in plain)  # every plain tensor, by our copy
    assert sum(big) >= copier.PREFAULT_FROM  # large enough that its source was faulted in ahead
    assert all(p._version > versions[k] for k, p in ours.named_parameters())


def test_load_module_state_keeps_load_state_dict_s_key_checks() -> None:
    from streamrover.ckpt import load_module_state

    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    state = {"weight": torch.randn(3, 4), "extra": torch.zeros(2)}
    with pytest.raises(RuntimeError, match="(?s)Missing key.*bias.*Unexpected key.*extra"):
        load_module_state(model, state)
    result = load_module_state(model, state, strict=False)
    assert result.missing_keys == ["bias"] and result.unexpected_keys == ["extra"]
    assert torch.equal(model.weight, state["weight"]) and torch.equal(model.bias, before[1])
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_module_state(model, {"weight": torch.randn(4, 4), "bias": torch.zeros(3)})


def test_copy_from_mapping_copies_in_order_when_ranges_write_the_same_bytes() -> None:
    from streamrover.ckpt import copier

    assert copier._overlapping([(0, 0, 10), (10, 0, 5)]) is False
    assert copier._overlapping([(0, 0, 10), (9, 0, 5)]) is True
    n = copier.PREFAULT_FROM
    dst = torch.zeros(n, dtype=torch.uint8)
    first, second = torch.full((n,), 1, dtype=torch.uint8), torch.full((n // 2,), 2, dtype=torch.uint8)
    copier.copy_from_mapping([(dst.data_ptr(), first.data_ptr(), n), (dst.data_ptr(), second.data_ptr(), n // 2)])
    assert int(dst[: n // 2].min()) == 2 and int(dst[n // 2 :].max()) == 1
