"""FlashTrainer loads a snapshot's weights into the model itself, not into an attribute that happens to be named
``module`` (it took any model with such an attribute for a DDP wrapper, and loaded into the wrong module)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hf = pytest.importorskip("streamrover.trainers.hf")


class Holder(torch.nn.Module):  # a user's model whose submodule is called ``module``
    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(2, 1)


def test_a_model_with_a_submodule_named_module_is_loaded_whole() -> None:
    model = Holder()
    state = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}  # module.weight, head.weight...
    hf.load_module_state(hf._unwrap(model), state)
    assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in model.state_dict().values())
    wrapped = torch.nn.DataParallel(model)  # a real wrapper is still unwrapped
    assert hf._unwrap(wrapped) is model
