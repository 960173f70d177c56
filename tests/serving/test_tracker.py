"""RowTracker: the stamps say exactly which rows changed since each checkpoint (in process, torch only)."""

from __future__ import annotations

import pytest

from streamrover.serving import RowTracker
from streamrover.serving.api import ServingError

torch = pytest.importorskip("torch")
nn = torch.nn


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(64, 3)
        self.b = nn.EmbeddingBag(32, 3, mode="sum")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.a(ids).sum(dim=1) + self.b(ids % 32)).sum(dim=1)


@pytest.mark.parametrize("max_pending", [RowTracker.MAX_PENDING, 3])
def test_stamps_above_each_checkpoint_are_exactly_the_rows_changed_since(max_pending: int) -> None:
    torch.manual_seed(0)
    model = Two()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = RowTracker(model)
    tracker.MAX_PENDING = max_pending  # 3: stamped between checkpoints too (what bounds memory)
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if k in tracker.params}
    previous, checked, early = 0, 0, None
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 13):
        out = model(torch.randint(0, 64, (4, 2), generator=gen)) if early is None else early
        loss = out.pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tracker.step_done(step)
        early = None
        if step % 4 == 0:
            early = model(torch.randint(0, 64, (4, 2), generator=gen))  # the next step's lookup, before the checkpoint
            stamps = tracker.state()
            for param, weight in model.state_dict().items():
                if param not in tracker.params:
                    continue
                changed = set(torch.nonzero((weight != before[param]).any(dim=1)).flatten().tolist())
                stamped = set(torch.nonzero(stamps[param] > previous).flatten().tolist())
                assert stamped == changed and changed, f"{param} at {step}: stamped {stamped}, changed {changed}"
                assert int(stamps[param].max()) <= step, "no row stamped after the checkpoint it is in"
                before[param] = weight.detach().clone()
                checked += 1
            previous = step
    assert checked == 6  # 3 checkpoints x 2 tables


def test_an_index_tensor_changed_in_place_before_the_checkpoint_is_refused() -> None:
    model = Two()
    tracker = RowTracker(model)
    buffer = torch.tensor([[1, 2]])
    model(buffer)
    tracker.step_done(1)
    buffer.copy_(torch.tensor([[3, 4]]))  # a reused input buffer: the rows of step 1 are gone
    with pytest.raises(ServingError, match="changed in place"):
        tracker.state()


def test_a_restore_forgets_lookups_not_yet_stamped() -> None:
    model = Two()
    tracker = RowTracker(model)
    model(torch.tensor([[5, 6]]))
    tracker.step_done(7)
    tracker.load_state(None)  # resumed from a checkpoint without stamps: the abandoned lookups are dropped
    assert all(int(s.max()) == 0 for s in tracker.state().values())
    with torch.inference_mode():
        model(torch.tensor([[9, 10]]))  # inference tensors have no version counter: still tracked
    tracker.step_done(8)
    assert int(tracker.state()["a.weight"][9]) == 8
