"""Shard planning: where shards start and end, and in which order they are handed out.

Shards of a partition lie on a grid: cell ``k`` is ``[start + k*size, start + (k+1)*size)``,
clipped to the partition's extent. A range still to be read (after a restore,
say) is split at grid points, so a shard's coordinates, and therefore its id,
do not depend on the history that led to it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamrover.cursor import IntervalSet
from streamrover.shard_service.api import PartitionPlan


@dataclass(frozen=True)
class PlannedShard:
    epoch: int
    partition: PartitionPlan
    start: int
    end: int

    @property
    def records(self) -> int:
        return self.end - self.start


def split_on_grid(origin: int, size: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Split each ``[a, b)`` at the grid points ``origin + k*size``."""
    if size <= 0:
        raise ValueError(f"shard size must be positive, got {size}")
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        pos = a
        while pos < b:
            cell_end = origin + ((pos - origin) // size + 1) * size
            nxt = min(cell_end, b)
            out.append((pos, nxt))
            pos = nxt
    return out


def epoch_order(shards: list[PlannedShard], shuffle: bool, seed: int, epoch: int) -> list[PlannedShard]:
    """The order in which an epoch's shards are leased: partition order, or a seeded shuffle."""
    ordered = sorted(shards, key=lambda s: (s.partition.index, s.start))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(ordered)
    return ordered


def plan_epoch(
    partitions: Sequence[PartitionPlan],
    epoch: int,
    size: int,
    shuffle: bool,
    seed: int,
    done: dict[tuple[int, str], IntervalSet] | None = None,
) -> list[PlannedShard]:
    """Shards covering every partition's extent in ``epoch`` except what ``done`` holds, in lease order.

    The order is the grid's full-epoch order (shuffled when asked), so an epoch
    re-planned after a restore keeps its original order for the shards left.
    """
    cells: list[PlannedShard] = []
    for part in partitions:
        covered = (done or {}).get((epoch, part.id), IntervalSet())
        todo = covered.missing(part.start, part.end)
        for a, b in split_on_grid(part.start, size, todo):
            cells.append(PlannedShard(epoch, part, a, b))
    # Order by the grid cell each piece falls in, then position: the order of the full plan.
    full = epoch_order(
        [PlannedShard(epoch, p, a, b) for p in partitions for a, b in split_on_grid(p.start, size, [(p.start, p.end)])],
        shuffle,
        seed,
        epoch,
    )
    rank = {(s.partition.index, s.start): i for i, s in enumerate(full)}

    def key(s: PlannedShard) -> tuple[int, int]:
        origin = s.partition.start
        cell_start = origin + ((s.start - origin) // size) * size
        return rank.get((s.partition.index, cell_start), len(rank)), s.start

    return sorted(cells, key=key)


def grid_cells_covered(part: PartitionPlan, size: int, covered: IntervalSet) -> int:
    """How many grid cells of ``part`` lie wholly inside ``covered``."""
    count = 0
    for s, e in covered:
        s, e = max(s, part.start), min(e, part.end)
        for a, b in split_on_grid(part.start, size, [(s, e)]):
            cell_start = part.start + ((a - part.start) // size) * size
            if a == cell_start and (b == min(cell_start + size, part.end)):
                count += 1
    return count
