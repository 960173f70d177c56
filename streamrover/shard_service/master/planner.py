"""Shard planning: where shards start and end, and in which order they are handed out.

Shards of a partition lie on a grid of *records*: cell ``k`` holds the partition's records
``[k*size, (k+1)*size)`` counted from its start, clipped to its extent. For a dense partition
that is the positions ``[start + k*size, start + (k+1)*size)``; for a sparse one (its records'
runs are known, sources/positions.py) a cell's boundaries are the positions of its first records,
so a gap between runs lies inside one cell instead of becoming a stream of empty cells. A range
still to be read (after a restore, say) is split at grid points, so a shard's coordinates, and
therefore its id, do not depend on the history that led to it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from streamrover.cursor import IntervalSet
from streamrover.shard_service.api import PartitionPlan
from streamrover.sources.positions import RecordRuns


@dataclass(frozen=True)
class PlannedShard:
    """A shard to add: ``[start, end)`` of ``partition`` in ``epoch``, with the records it holds."""
    epoch: int
    partition: PartitionPlan
    start: int
    end: int
    records: int = -1  # records in [start, end); -1: a dense range, end - start

    def __post_init__(self) -> None:
        if self.records < 0:
            object.__setattr__(self, "records", self.end - self.start)


class RecordSpace:
    """A partition's positions seen as record ranks from its start: dense, or by its runs."""

    def __init__(self, part: PartitionPlan, runs: RecordRuns | None = None) -> None:
        self.origin = part.start
        self.runs = runs
        self.base = runs.rank(part.start) if runs is not None else 0
        self.total = self.rank(part.end)

    def rank(self, position: int) -> int:
        """Records of the partition at positions in ``[start, position)``."""
        if self.runs is None:
            return position - self.origin
        return self.runs.rank(position) - self.base

    def select(self, k: int) -> int:
        """The position of the record of rank ``k``."""
        return self.origin + k if self.runs is None else self.runs.select(self.base + k)

    def cell(self, position: int, size: int) -> int:
        """The grid cell a position falls in."""
        return self.rank(position) // size

    def split(self, size: int, a: int, b: int) -> list[tuple[int, int, int]]:
        """``[a, b)`` split at the grid's cell boundaries: (start, end, records) pieces; one piece if it holds none."""
        if size <= 0:
            raise ValueError(f"shard size must be positive, got {size}")
        i, j = self.rank(a), self.rank(b)
        out: list[tuple[int, int, int]] = []
        pos, k = a, i
        while True:
            nxt = (k // size + 1) * size
            if nxt >= j:
                out.append((pos, b, j - k))
                return out
            cut = self.select(nxt)
            out.append((pos, cut, nxt - k))
            pos, k = cut, nxt


def split_on_grid(origin: int, size: int, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Split each dense ``[a, b)`` at the grid points ``origin + k*size``."""
    space = RecordSpace(PartitionPlan(0, "", origin, origin))
    return [(x, y) for a, b in ranges if a < b for x, y, _ in space.split(size, a, b)]


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
    runs: Mapping[int, RecordRuns] | None = None,
) -> list[PlannedShard]:
    """Shards covering every partition's extent in ``epoch`` except what ``done`` holds, in lease order.

    ``runs`` (by partition index) are the records' runs of sparse partitions. The order is the grid's
    full-epoch order (shuffled when asked), so an epoch re-planned after a restore keeps its original
    order for the shards left. Unshuffled, that order is partition then position, so the plan costs
    only what is left: a stream's restore never walks the history before its cursor (it did, and its
    peak grew with the stream: the soak's master kept ~200 bytes per ack of it).
    """
    spaces = {p.index: RecordSpace(p, (runs or {}).get(p.index)) for p in partitions}
    cells: list[PlannedShard] = []
    for part in partitions:
        covered = (done or {}).get((epoch, part.id), IntervalSet())
        for a, b in covered.missing(part.start, part.end):
            cells.extend(PlannedShard(epoch, part, x, y, n) for x, y, n in spaces[part.index].split(size, a, b))
    if not shuffle:  # the full plan's order (cells follow positions), without building the full plan
        return sorted(cells, key=lambda s: (s.partition.index, s.start))
    # Order by the grid cell each piece falls in, then position: the order of the full plan.
    full = epoch_order(
        [
            PlannedShard(epoch, p, a, b, n)
            for p in partitions
            if p.start < p.end
            for a, b, n in spaces[p.index].split(size, p.start, p.end)
        ],
        shuffle,
        seed,
        epoch,
    )
    rank = {(s.partition.index, spaces[s.partition.index].cell(s.start, size)): i for i, s in enumerate(full)}

    def key(s: PlannedShard) -> tuple[int, int]:
        return rank.get((s.partition.index, spaces[s.partition.index].cell(s.start, size)), len(rank)), s.start

    return sorted(cells, key=key)


def grid_cells_covered(part: PartitionPlan, size: int, covered: IntervalSet, runs: RecordRuns | None = None) -> int:
    """How many grid cells of ``part`` (cells of ``size`` records) lie wholly inside ``covered``."""
    space = RecordSpace(part, runs)
    n = space.total
    last = -(-n // size) - 1  # the last cell (it may hold fewer records)
    count = 0
    for s, e in covered:
        s, e = max(s, part.start), min(e, part.end)
        if s >= e:
            continue
        i, j = space.rank(s), space.rank(e)
        first = -(-i // size)
        upto = last if j >= n else j // size - 1
        count += max(upto - first + 1, 0)
    return count
