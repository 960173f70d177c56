"""Uneven inputs in synchronous data parallelism: ranks step together, idle ones at once, gradients weighed by records.

In DDP every rank must take part in every step's collectives (the gradient all-reduce and any
of the script's own). A stream gives ranks uneven inputs: one rank's leases may be empty for a
while and then fill again. Two pieces make that cost nothing and change no update:

- :class:`StepSync`: before each batch a :class:`~streamrover.trainers.torch.StreamDataset`
  all-reduces (rows it has, ended, idle too long) with the other ranks: one small collective per
  step on a gloo group. If any rank has records, every rank steps at once, a rank without
  records with an empty batch (it shadows the step's collectives; nothing waits for its
  ``idle_timeout``). If no rank has records, the ranks poll again after 1, 2, 4... up to 50 ms
  (a record arriving on any rank is trained within that), and step with empty batches only
  when some rank has waited ``idle_timeout``, or end together when every rank's dataset ended.
- :class:`GradWeighting` (installed by :class:`~streamrover.trainers.torch.StreamSession`):
  a hook on every parameter multiplies this rank's gradient by ``n_r * world / N`` (``n_r`` its
  records in the step, ``N`` all ranks' records) before DDP averages it over the world. For a
  loss that is the mean over the batch the reduced gradient is then the mean over the step's
  records of all ranks: the gradient one process would compute on all of them, whichever rank
  read which record. A rank without records contributes zeros (whatever its loss of an empty
  batch is, a NaN mean included); when all ranks have full batches the factor is 1.

``torch.distributed.algorithms.Join`` does not fit a stream: its context ends only when every
rank's input is exhausted (a rank idle for a while cannot join and come back), it shadows only
the collectives of ``Joinable`` objects (not the script's own all-reduce of, say, a ledger), and
it divides by the initial world size (a joined rank's zeros halve the update) or by the ranks
not yet joined (each rank's mean weighed alike, whatever its batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

MAX_POLL = 0.05  # seconds between the all-reduces of ranks that all wait for records


class StepSync:
    """The per-batch all-reduce of a dataset over the default group's ranks (a gloo group of its own if NCCL)."""

    def __init__(self, on_round: Callable[[], None] | None = None) -> None:
        self.on_round = on_round  # after each round: the worker's progress mark (pace.py)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._group: Any = None
        self._grouped = False

    def reduce(self, rows: int, ended: bool, expired: bool) -> tuple[int, int, int]:
        """Sums over the ranks of (rows, ended, expired); a collective when the world has more than one rank."""
        if self.world == 1:
            return rows, int(ended), int(expired)
        if not self._grouped:  # the first batch of this dataset, on every rank at the same point
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._grouped = True
        sums = torch.tensor([rows, int(ended), int(expired)], dtype=torch.int64)
        dist.all_reduce(sums, group=self._group)
        if self.on_round is not None:
            self.on_round()
        total, ended_ranks, expired_ranks = (int(v) for v in sums.tolist())
        return total, ended_ranks, expired_ranks

    def poll(self, quiet_rounds: int, idle_left: float | None) -> float | None:
        """How long to wait for this rank's next batch before the next all-reduce (None: as long as it takes).

        Right after a step nobody waits (a rank with records must not wait for one without); after
        rounds in which no rank had records, 1, 2, 4... up to :data:`MAX_POLL` ms. One rank alone waits
        for its records or its idle timeout.
        """
        if self.world == 1:
            return None if idle_left is None else max(idle_left, 0.0)
        wait = 0.0 if quiet_rounds == 0 else min(0.001 * 2 ** (quiet_rounds - 1), MAX_POLL)
        return wait if idle_left is None else max(min(wait, idle_left), 0.0)



class StepRows(Protocol):
    """What :class:`GradWeighting` reads of a dataset for the step under way."""

    step_batches: int  # batches yielded since the last step_done
    step_rows: int  # this rank's records in them
    step_total: int  # all ranks' records in them


class GradWeighting:
    """Multiplies each parameter's gradient by ``n_r * world / N`` of the step under way (module docstring)."""

    def __init__(self, datasets: Sequence[StepRows], world: int) -> None:
        self.datasets = datasets
        self.world = world
        self.handles: list[Any] = []

    def install(self, parameters: Iterable[torch.Tensor]) -> GradWeighting:
        for p in parameters:
            if p.requires_grad:
                self.handles.append(p.register_hook(self._weigh))
        return self

    def factor(self) -> float | None:
        """The step's factor; None when no dataset of the session yielded a batch since the last step."""
        if not any(d.step_batches for d in self.datasets):
            return None
        local = sum(d.step_rows for d in self.datasets)
        total = sum(d.step_total for d in self.datasets)
        return local * self.world / total if local else 0.0

    def _weigh(self, grad: torch.Tensor) -> torch.Tensor | None:
        factor = self.factor()
        if factor is None or factor == 1.0:
            return None
        if factor == 0.0:
            return torch.zeros_like(grad)
        return grad * factor

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
