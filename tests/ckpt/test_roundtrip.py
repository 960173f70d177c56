"""Round trips of states through shared memory and through storage: dtypes, shapes, nesting."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrover.ckpt import Checkpointer, LoadedFrom, UnsupportedStateError
from streamrover.ckpt.flatten import DTYPES, flatten, unflatten

TORCH_DTYPES = [getattr(torch, t) for _, t, _ in DTYPES.values() if t]
NUMPY_DTYPES = [n for n, _, _ in DTYPES.values() if n]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (compares NaNs and every dtype exactly)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    same_kind = type(a) is type(b) or any(isinstance(a, k) and isinstance(b, k) for k in (torch.Tensor, dict))
    assert same_kind, f"{path}: {type(a)} vs {type(b)}"  # OrderedDict comes back as dict (same order)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(raw(a), raw(b)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def rich_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, Any] = {}
    for dt in TORCH_DTYPES:
        base = torch.randint(0, 100, (3, 5), generator=gen).to(torch.float32) / 7
        tensors[str(dt)] = base.to(dt) if dt.is_floating_point or dt.is_complex else base.to(torch.int64).to(dt)
    big = torch.randn(64, 48, generator=gen)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {
        "torch": tensors,
        "numpy": {n: (np.arange(12) % 5).astype(n).reshape(3, 4) for n in NUMPY_DTYPES},
        "empty": [torch.empty(0, 7), np.zeros((0,), dtype=np.int32), torch.empty(0, dtype=torch.bfloat16)],
        "non_contiguous": {"t": big.t(), "slice": big[::3, 5:17], "expanded": torch.arange(4.0).expand(3, 4)},
        "np_non_contiguous": np.arange(60.0).reshape(6, 10)[::2, ::3],
        "scalar_tensor": torch.tensor(3.5, dtype=torch.bfloat16),
        "np_scalar": np.float32(2.25),
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "meta": {"lr": 0.1, "name": "ctr", "none": None, "flag": True, "nan": float("nan"), 7: (1, [2, "x"])},
        "blob": b"\x00\xffbytes",
    }


def test_flatten_roundtrip_in_process() -> None:
    state = rich_state()
    skeleton, entries = flatten(state)
    json.dumps(skeleton)  # the skeleton is plain JSON
    rebuilt = unflatten(skeleton, lambda i: entries[i].value)
    assert_same(state, rebuilt)


@pytest.mark.parametrize("from_memory", [True, False])
def test_every_dtype_and_shape_round_trips(root: str, from_memory: bool) -> None:
    state = rich_state()
    with Checkpointer(root, saver="thread") as ckpt:
        ckpt.save(3, state)
        ckpt.wait(timeout=60)
        loaded = ckpt.load(memory=from_memory)
    assert loaded.source == (LoadedFrom.MEMORY if from_memory else LoadedFrom.STORAGE)
    assert loaded.step == 3
    assert_same(state, loaded.state)


def test_optimizer_state_loads_back_into_torch(root: str) -> None:
    state = rich_state()
    with Checkpointer(root, saver="thread") as ckpt:
        ckpt.save(1, {"optim": state["optim"], "model": state["model"]})
        ckpt.wait(timeout=60)
        loaded = ckpt.load(memory=False)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(loaded.state["model"])
    optim = torch.optim.Adam(model.parameters())
    optim.load_state_dict(loaded.state["optim"])
    assert_same(optim.state_dict(), state["optim"])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"x": object()}, "x: a builtins.object cannot be checkpointed"),
        ({(1, 2): 3}, "is not a str or int"),
        ({True: 1}, "is not a str or int"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, "complex128"),
    ],
)
def test_unsupported_values_are_named(bad: dict[Any, Any], message: str) -> None:
    with pytest.raises(UnsupportedStateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flatten(bad)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.builds(lambda n, d: (np.arange(n) * 3).astype(d), st.integers(0, 9), st.sampled_from(NUMPY_DTYPES)),
)
states = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states)
def test_any_nested_state_round_trips_through_shared_memory(root: str, state: Any) -> None:
    ckpt = Checkpointer(root, saver="thread")
    try:
        ckpt.save(1, {"s": state}, persist=False)
        assert_same({"s": state}, ckpt.load().state)
    finally:
        ckpt.close(unlink=True)


def test_importing_ckpt_does_not_import_torch() -> None:
    code = "import sys, streamrover.ckpt; print('torch' in sys.modules, 'tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
