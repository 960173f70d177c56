"""Counting records over positions that are not dense (the sources/api.py position contract).

A dense partition holds one record at every position of ``[start, end)``. A sparse one (Pulsar:
``ledger << bits | entry``, a ledger rollover jumps the position by up to ``2**bits``) says where its
records lie as *runs*: sorted, disjoint ``[a, b)`` ranges that hold one record per position; a
position outside every run holds none. :class:`RecordRuns` keeps a partition's runs and answers how
many records lie in a range (:meth:`RecordRuns.count`), how many lie before a position
(:meth:`RecordRuns.rank`) and where the k-th record is (:meth:`RecordRuns.select`): what the master
needs to size shards, re-plan after a restore and report counts and lag in records.

Runs are a description, never a boundary: a shard always covers every position of its range, so a
run the master never learned (a ledger that came and went between two polls) only makes a shard
hold more records than planned and a count low; it never loses a record.

One run per ledger grows without bound, so the master folds the runs below what it has committed
upstream (:meth:`RecordRuns.compact`): they become one run of as many records from the first
run's start, so every rank from that position on is unchanged; runs reported below it later are
ignored.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator


class RecordRuns:
    """The runs of positions that hold records, merged (a union: a run learned once is kept)."""

    def __init__(self, runs: Iterable[tuple[int, int]] = (), floor: int | None = None) -> None:
        #: Runs below it were folded by :meth:`compact`: what is reported below it is ignored (None: nothing was).
        self.floor = floor
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._before: list[int] = []  # records in the runs before run i
        #: The lowest start among runs changed (added, grown, merged away) since :meth:`take_changed`;
        #: None when nothing changed. Lets a journal rewrite only the changed tail (normally one run).
        self.changed_from: int | None = None
        self.add(runs)

    def add(self, runs: Iterable[tuple[int, int]]) -> bool:
        """Merge ``runs`` in (clipped to :attr:`floor`). Returns whether anything changed."""
        low = self.floor if self.floor is not None else -(1 << 63)
        merged = sorted([*zip(self._starts, self._ends), *((max(a, low), b) for a, b in runs if max(a, low) < b)])
        return self._set(merged)

    def compact(self, position: int) -> bool:
        """Fold the runs below ``position`` into one run of their ``n`` records from the first run's start.

        Ranks at and above ``position`` stay the same, as does every count of a range that starts at or
        before the first run (the partition's start) or at or after ``position``. Done when at least two
        runs start below ``position`` (else nothing would shrink); sets :attr:`floor`. Returns whether
        anything changed.
        """
        if bisect.bisect_left(self._starts, position) < 2:
            return False
        first, n = self._starts[0], self.rank(position)
        kept = [(max(a, position), b) for a, b in self if b > position]
        self.floor = position
        return self._set([(first, first + n), *kept])

    def _set(self, merged: list[tuple[int, int]]) -> bool:
        starts: list[int] = []
        ends: list[int] = []
        for a, b in merged:
            if starts and a <= ends[-1]:
                ends[-1] = max(ends[-1], b)
            else:
                starts.append(a)
                ends.append(b)
        if starts == self._starts and ends == self._ends:
            return False
        i = 0
        while i < min(len(starts), len(self._starts)) and (starts[i], ends[i]) == (self._starts[i], self._ends[i]):
            i += 1
        first = min(x[i] for x in (starts, self._starts) if i < len(x))
        self.changed_from = first if self.changed_from is None else min(self.changed_from, first)
        self._starts, self._ends = starts, ends
        total = 0
        self._before = []
        for a, b in zip(starts, ends):
            self._before.append(total)
            total += b - a
        return True

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._ends))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordRuns) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RecordRuns({list(self)!r})"

    def to_list(self) -> list[list[int]]:
        """The runs as ``[[start, end], ...]`` (JSON-ready)."""
        return [[a, b] for a, b in self]

    @classmethod
    def from_list(cls, items: Iterable[Iterable[int]]) -> RecordRuns:
        """Runs from :meth:`to_list` output."""
        return cls((int(a), int(b)) for a, b in items)

    def between(self, start: int, end: int) -> list[tuple[int, int]]:
        """The runs that overlap ``[start, end)``, clipped to it."""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        out = []
        while i < len(self._starts) and self._starts[i] < end:
            a, b = max(self._starts[i], start), min(self._ends[i], end)
            if a < b:
                out.append((a, b))
            i += 1
        return out

    def take_changed(self) -> tuple[int, list[tuple[int, int]]] | None:
        """(:attr:`changed_from`, the runs that start there or later), or None if nothing changed; resets it."""
        if self.changed_from is None:
            return None
        lo, self.changed_from = self.changed_from, None
        return lo, [(a, b) for a, b in self if a >= lo]

    def rank(self, position: int) -> int:
        """How many records lie at positions below ``position``."""
        i = bisect.bisect_right(self._starts, position) - 1
        if i < 0:
            return 0
        return self._before[i] + min(position, self._ends[i]) - self._starts[i]

    def count(self, start: int, end: int) -> int:
        """How many records lie in ``[start, end)``."""
        return max(self.rank(end) - self.rank(start), 0)

    def select(self, k: int) -> int:
        """The position of the record with rank ``k`` (0 = the first); past the last: the last run's end."""
        if not self._starts:
            return 0
        i = bisect.bisect_right(self._before, k) - 1
        if i < 0:
            return self._starts[0]
        offset = k - self._before[i]
        if offset >= self._ends[i] - self._starts[i]:
            return self._ends[i]
        return self._starts[i] + offset
