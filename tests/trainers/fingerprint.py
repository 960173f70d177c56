"""What the framework scripts log at each step to show a resume restored the whole training state."""

from __future__ import annotations

import hashlib

import torch


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of the weights, the optimizer's tensors and learning rate: equal in two runs at the same step only
    if the second restored all three exactly."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            digest.update(torch.as_tensor(value).detach().cpu().contiguous().numpy().tobytes())
    digest.update(repr([group["lr"] for group in optimizer.param_groups]).encode())
    return digest.hexdigest()[:16]
