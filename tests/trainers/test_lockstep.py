"""``GradWeighting``: each rank's gradient weighed by its share of the step's records, an empty batch's zeroed.

The two-rank run under ``dlrover-run`` (test_idle_rank.py) checks the reduced gradient against the
global batch's; here the factor's cases in one process: a rank with all of a 2-rank step's records
has its gradient doubled (DDP's average over two ranks then halves it back), a rank without records
contributes zeros even when its loss over no rows is a NaN mean, and nothing is touched on a step
for which the session's datasets yielded no batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrover.trainers.torch.lockstep import MAX_POLL, GradWeighting, StepSync


@dataclass
class _Step:
    step_batches: int = 0
    step_rows: int = 0
    step_total: int = 0


def _grads(rows: int, step: _Step, world: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    weighting = GradWeighting([step], world).install(net.parameters())
    x = torch.randn(rows, 3)
    torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True)).backward()  # a mean: NaN over no rows
    weighting.remove()
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def test_gradients_are_weighed_by_the_rank_s_share_of_the_step_s_records() -> None:
    plain = _grads(8, _Step())  # no batch yielded this step: untouched
    assert all(torch.isfinite(g).all() for g in plain)
    both = _grads(8, _Step(1, 8, 16))  # both ranks had 8: factor 1
    alone = _grads(8, _Step(1, 8, 8))  # this rank had all of them: factor 2
    quarter = _grads(8, _Step(1, 8, 32))  # 8 of 32 records: factor 0.5
    for p, b, a, q in zip(plain, both, alone, quarter, strict=True):
        assert torch.equal(b, p) and torch.allclose(a, 2 * p) and torch.allclose(q, 0.5 * p)
    empty = _grads(0, _Step(1, 0, 8))  # the idle rank: its NaN mean becomes zeros
    assert all(torch.equal(g, torch.zeros_like(g)) for g in empty)


def test_ranks_that_all_wait_poll_again_sooner_than_an_idle_timeout_and_back_off() -> None:
    sync = StepSync()
    sync.world = 2  # the schedule only; reduce() is the collective
    waits = [sync.poll(quiet, None) for quiet in range(12)]
    assert waits[0] == 0.0, "right after a step nobody waits"
    assert waits[1:4] == [0.001, 0.002, 0.004] and max(waits) == MAX_POLL
    assert sync.poll(9, 0.01) == 0.01, "never past the idle timeout"
    sync.world = 1
    assert sync.poll(0, None) is None and sync.poll(3, 0.2) == 0.2, "one rank alone waits for its records"
