"""A DeepFM CTR model over hashed ``EmbeddingBag`` tables, and the exactly-once state kept beside it.

:class:`DeepFM`: each categorical field's 40-bit hash goes through a multiplicative hash into its
own table (``2**table_bits`` rows): a 1-wide table for the linear part and a ``dim``-wide one shared
by the factorisation machine (pairwise dot products of the fields' vectors) and the deep part (an
MLP over the field vectors and the numeric fields).

:class:`CtrState`: buffers registered on the training module, so they are checkpointed and
restored with the weights, and identical on every rank (each step's records are gathered from
all ranks and applied everywhere): the **ledger** (how often each record id was applied, their
count and sum of ids), the progressive-validation window rows (examples/streaming_ctr/metrics.py)
and the freshness histogram. A record trained after the last checkpoint and lost in a crash is
gone from all three at restore, and counted again when it is trained again: exactly once.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
from examples.streaming_ctr.metrics import FRESH_EDGES_MS, ROW

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer


def hash_into(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Fibonacci hashing of int64 values into ``[0, 2**bits)`` (the product wraps around, as intended)."""
    return ((values * _GOLDEN) >> (64 - bits)) & ((1 << bits) - 1)


class DeepFM(nn.Module):
    """DeepFM (Guo et al., 2017) with one hashed EmbeddingBag table per categorical field."""

    def __init__(self, table_bits: int = 12, dim: int = 8, hidden: tuple[int, ...] = (64, 32)) -> None:
        super().__init__()
        self.table_bits = table_bits
        rows = 1 << table_bits
        self.linear = nn.ModuleList(nn.EmbeddingBag(rows, 1, mode="sum") for _ in CATEGORICAL)
        self.vectors = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in CATEGORICAL)
        for table in self.vectors:
            nn.init.normal_(table.weight, 0.0, 0.01)
        for table in self.linear:
            nn.init.zeros_(table.weight)
        self.numeric = nn.Linear(len(NUMERIC), 1)
        layers: list[nn.Module] = []
        width = dim * len(CATEGORICAL) + len(NUMERIC)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)
        self.bias = nn.Parameter(torch.tensor([-1.5]))

    def forward(self, cats: torch.Tensor, nums: torch.Tensor) -> torch.Tensor:
        """Logits of a batch: ``cats`` int64 ``[B, fields]`` (raw hashes), ``nums`` float ``[B, numerics]``."""
        idx = hash_into(cats, self.table_bits)
        linear = sum(t(idx[:, i: i + 1]) for i, t in enumerate(self.linear))
        vecs = torch.stack([t(idx[:, i: i + 1]) for i, t in enumerate(self.vectors)], dim=1)  # [B, F, D]
        square_of_sum = vecs.sum(dim=1).pow(2)
        sum_of_squares = vecs.pow(2).sum(dim=1)
        fm = 0.5 * (square_of_sum - sum_of_squares).sum(dim=1, keepdim=True)
        deep = self.deep(torch.cat([vecs.flatten(1), nums], dim=1))
        return (self.bias + linear + fm + self.numeric(nums) + deep).squeeze(1)


class CtrState(nn.Module):
    """The model plus its ledger, window rows and freshness histogram (see the module docstring)."""

    def __init__(self, records: int, windows: int, **model: int) -> None:
        super().__init__()
        self.net = DeepFM(**model)  # type: ignore[arg-type]
        self.register_buffer("ledger", torch.zeros(records, dtype=torch.int32))
        self.register_buffer("ledger_sums", torch.zeros(2, dtype=torch.int64))  # records applied, sum of their ids
        self.register_buffer("windows", torch.zeros(windows, ROW, dtype=torch.float64))
        self.register_buffer("freshness", torch.zeros(len(FRESH_EDGES_MS) - 1, dtype=torch.float64))
        self.register_buffer("applied_span", torch.zeros(2, dtype=torch.float64))  # first and last step, epoch ms


def features(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cats, nums, clicked)`` of a collated batch of records."""
    cats = torch.stack([batch[c].long() for c in CATEGORICAL], dim=1)
    nums = torch.stack([batch[n].float() for n in NUMERIC], dim=1)
    return cats, nums, batch["clicked"].float()
