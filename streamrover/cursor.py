"""The data cursor: which records' effect is in a model state.

A cursor maps each (dataset, epoch, partition) to an :class:`IntervalSet` of
half-open position intervals ``[start, end)``. Positions are integers whose
meaning the source defines (file row index, Kafka offset, ...); nothing here
assumes they are dense: an interval covers *positions*, whatever records exist
at them.

This module depends on nothing but the standard library, so that checkpoints
(``streamrover.ckpt``) can store and load cursors without importing the shard
service. The JSON form (:meth:`DataCursor.to_json`) is what checkpoint
manifests hold; it is versioned and stable.

Besides the positions whose effect is in the model, a cursor can account for positions
that are **lost**: deleted upstream (retention, ``delete_records``) before anything
trained them, and skipped because the dataset says ``sr.on_data_loss=skip``. Lost
positions are not trained: :meth:`DataCursor.items`, :meth:`DataCursor.get` and
:meth:`DataCursor.size` never include them, so the exactly-once contract reads "the
records whose effect is in the model are exactly those in the cursor's trained
intervals", and a ledger of such a run equals the produced records minus the lost
ones. They travel with the cursor (:meth:`DataCursor.lost_items`, the JSON's
``"lost"`` object, present only when something was lost, which readers of older
builds ignore) so every checkpoint's lineage says what its model never saw.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

CURSOR_FORMAT_VERSION = 1


class CursorError(ValueError):
    """A cursor or interval was malformed (bad JSON, reversed interval...)."""


class IntervalSet:
    """A set of integer positions kept as sorted, disjoint, non-adjacent ``[start, end)`` runs.

    Adjacent and overlapping intervals are merged on insertion, so the
    representation of a set is unique: two sets are equal exactly when their
    interval lists are equal.
    """

    __slots__ = ("_ends", "_starts")

    def __init__(self, intervals: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in intervals:
            self.add(start, end)

    # -- queries -------------------------------------------------------------
    def intervals(self) -> list[tuple[int, int]]:
        """The runs, in order, as ``(start, end)`` pairs."""
        return list(zip(self._starts, self._ends))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._ends))

    def __len__(self) -> int:
        """Number of intervals (not positions); see :meth:`size`."""
        return len(self._starts)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def size(self) -> int:
        """Number of positions covered."""
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def __contains__(self, position: object) -> bool:
        if not isinstance(position, int):
            return False
        i = bisect.bisect_right(self._starts, position) - 1
        return i >= 0 and position < self._ends[i]

    def covers(self, start: int, end: int) -> bool:
        """True when every position of ``[start, end)`` is in the set (an empty range is covered)."""
        if end <= start:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def overlaps(self, start: int, end: int) -> bool:
        """True when some position of ``[start, end)`` is in the set."""
        if end <= start:
            return False
        i = bisect.bisect_left(self._ends, start + 1)
        return i < len(self._starts) and self._starts[i] < end

    def prefix_end(self, start: int) -> int:
        """The end of the run that contains ``start``, or ``start`` if it is not covered."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and start < self._ends[i]:
            return self._ends[i]
        return start

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The sub-intervals of ``[start, end)`` that are not in the set, in order."""
        gaps: list[tuple[int, int]] = []
        cursor = start
        i = bisect.bisect_right(self._ends, start)
        while cursor < end and i < len(self._starts):
            s, e = self._starts[i], self._ends[i]
            if s >= end:
                break
            if s > cursor:
                gaps.append((cursor, s))
            cursor = max(cursor, e)
            i += 1
        if cursor < end:
            gaps.append((cursor, end))
        return gaps

    # -- updates -------------------------------------------------------------
    def add(self, start: int, end: int) -> None:
        """Insert ``[start, end)``, merging with overlapping or adjacent runs."""
        if not (isinstance(start, int) and isinstance(end, int)):
            raise CursorError(f"interval bounds must be integers, got [{start!r}, {end!r})")
        if end < start:
            raise CursorError(f"interval [{start}, {end}) is reversed")
        if end == start:
            return
        lo = bisect.bisect_left(self._ends, start)  # first run ending at or after start
        hi = bisect.bisect_right(self._starts, end)  # runs starting after end are untouched
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def update(self, other: IntervalSet) -> None:
        """Add every run of ``other``."""
        for s, e in other:
            self.add(s, e)

    def copy(self) -> IntervalSet:
        """An independent copy."""
        out = IntervalSet()
        out._starts = list(self._starts)
        out._ends = list(self._ends)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntervalSet):
            return NotImplemented
        return self._starts == other._starts and self._ends == other._ends

    def __hash__(self) -> int:  # pragma: no cover - mutable, like set
        raise TypeError("IntervalSet is mutable and unhashable")

    def __repr__(self) -> str:
        body = ", ".join(f"[{s}, {e})" for s, e in self)
        return f"IntervalSet({body})"

    def to_list(self) -> list[list[int]]:
        """The runs as ``[[start, end], ...]`` (JSON's form)."""
        return [[s, e] for s, e in self]

    @classmethod
    def from_list(cls, data: Iterable[Any]) -> IntervalSet:
        """The set :meth:`to_list` wrote; :class:`CursorError` for a malformed or reversed run."""
        out = cls()
        for item in data:
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise CursorError(f"an interval must be a [start, end] pair, got {item!r}")
            out.add(item[0], item[1])
        return out


@dataclass(frozen=True, order=True)
class PartitionKey:
    """Identifies one ordered log of one dataset in one epoch (streams use epoch 0)."""

    dataset: str
    epoch: int
    partition: str

    def __str__(self) -> str:
        return f"{self.dataset}[epoch {self.epoch}]/{self.partition}"


class DataCursor:
    """Per (dataset, epoch, partition), the positions whose effect is in a model state."""

    def __init__(
        self,
        entries: Mapping[PartitionKey, IntervalSet] | None = None,
        lost: Mapping[PartitionKey, IntervalSet] | None = None,
    ) -> None:
        self._entries: dict[PartitionKey, IntervalSet] = {}
        self._lost: dict[PartitionKey, IntervalSet] = {}  # positions deleted upstream before they were trained
        for key, ivs in (entries or {}).items():
            if ivs:
                self._entries[key] = ivs.copy()
        for key, ivs in (lost or {}).items():
            if ivs:
                self._lost[key] = ivs.copy()

    def keys(self) -> list[PartitionKey]:
        """The partitions with positions, sorted."""
        return sorted(self._entries)

    def items(self) -> list[tuple[PartitionKey, IntervalSet]]:
        """``(partition, positions)`` pairs, sorted by partition."""
        return [(k, self._entries[k]) for k in sorted(self._entries)]

    def get(self, key: PartitionKey) -> IntervalSet:
        """The intervals for ``key`` (a copy; empty if absent)."""
        ivs = self._entries.get(key)
        return ivs.copy() if ivs is not None else IntervalSet()

    def add(self, key: PartitionKey, start: int, end: int) -> None:
        """Add positions ``[start, end)`` of ``key`` (an empty range adds nothing)."""
        if end <= start:
            return
        self._entries.setdefault(key, IntervalSet()).add(start, end)

    def update(self, other: DataCursor) -> None:
        """Add every position of ``other``, its lost part included."""
        for key, ivs in other._entries.items():
            self._entries.setdefault(key, IntervalSet()).update(ivs)
        for key, ivs in other._lost.items():
            self._lost.setdefault(key, IntervalSet()).update(ivs)

    # -- lost positions (see the module docstring) ---------------------------
    def lost_items(self) -> list[tuple[PartitionKey, IntervalSet]]:
        """Per partition, the positions accounted as lost (deleted upstream before they were trained)."""
        return [(k, self._lost[k]) for k in sorted(self._lost)]

    def get_lost(self, key: PartitionKey) -> IntervalSet:
        """The lost intervals of ``key`` (a copy; empty if none)."""
        ivs = self._lost.get(key)
        return ivs.copy() if ivs is not None else IntervalSet()

    def add_lost(self, key: PartitionKey, start: int, end: int) -> None:
        """Add ``[start, end)`` of ``key`` to the lost part: positions skipped as deleted upstream."""
        if end > start:
            self._lost.setdefault(key, IntervalSet()).add(start, end)

    def lost_size(self) -> int:
        """Number of positions accounted as lost."""
        return sum(ivs.size() for ivs in self._lost.values())

    def datasets(self) -> list[str]:
        """The datasets with positions, sorted."""
        return sorted({k.dataset for k in self._entries})

    def only(self, dataset: str) -> DataCursor:
        """The part of this cursor that belongs to ``dataset``."""
        return DataCursor(
            {k: v for k, v in self._entries.items() if k.dataset == dataset},
            {k: v for k, v in self._lost.items() if k.dataset == dataset},
        )

    def size(self) -> int:
        """How many positions the cursor covers (its lost part excluded)."""
        return sum(ivs.size() for ivs in self._entries.values())

    def copy(self) -> DataCursor:
        """An independent copy."""
        return DataCursor(self._entries, self._lost)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataCursor):
            return NotImplemented
        return self.items() == other.items() and self.lost_items() == other.lost_items()

    def __repr__(self) -> str:
        parts = "; ".join(f"{k}: {v.to_list()}" for k, v in self.items())
        lost = "; ".join(f"{k}: {v.to_list()}" for k, v in self.lost_items())
        return f"DataCursor({parts}{'; lost ' + lost if lost else ''})"

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"version": 1, "datasets": {name: {epoch: {partition: [[s, e], ...]}}}}``.

        Lost positions, if any, are under ``"lost"`` in the same shape as ``"datasets"``.
        """
        out: dict[str, Any] = {"version": CURSOR_FORMAT_VERSION, "datasets": _nest(self.items())}
        if self._lost:
            out["lost"] = _nest(self.lost_items())
        return out

    def to_json(self) -> str:
        """The cursor as compact JSON (what manifests and the journal hold)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataCursor:
        """The cursor :meth:`to_dict` wrote; :class:`CursorError` naming what is malformed."""
        if not isinstance(data, Mapping):
            raise CursorError(f"a cursor must be a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != CURSOR_FORMAT_VERSION:
            raise CursorError(
                f"unsupported cursor format version {version!r} (this build reads {CURSOR_FORMAT_VERSION})"
            )
        out = cls()
        for section, target in (("datasets", out._entries), ("lost", out._lost)):
            _unnest(data.get(section, {}), section, target)
        return out

    @classmethod
    def from_json(cls, text: str | bytes) -> DataCursor:
        """The cursor :meth:`to_json` wrote; :class:`CursorError` for bad JSON or a malformed cursor."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CursorError(f"cursor is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def _nest(items: Iterable[tuple[PartitionKey, IntervalSet]]) -> dict[str, dict[str, dict[str, list[list[int]]]]]:
    nested: dict[str, dict[str, dict[str, list[list[int]]]]] = {}
    for key, ivs in items:
        nested.setdefault(key.dataset, {}).setdefault(str(key.epoch), {})[key.partition] = ivs.to_list()
    return nested


def _unnest(datasets: Any, section: str, target: dict[PartitionKey, IntervalSet]) -> None:
    if not isinstance(datasets, Mapping):
        raise CursorError(f"cursor {section!r} must be an object")
    for name, epochs in datasets.items():
        if not isinstance(epochs, Mapping):
            raise CursorError(f"cursor entry for dataset {name!r} must be an object of epochs")
        for epoch, partitions in epochs.items():
            try:
                epoch_no = int(epoch)
            except ValueError as exc:
                raise CursorError(f"dataset {name!r}: epoch {epoch!r} is not an integer") from exc
            if not isinstance(partitions, Mapping):
                raise CursorError(f"dataset {name!r} epoch {epoch}: partitions must be an object")
            for partition, ivs in partitions.items():
                key = PartitionKey(str(name), epoch_no, str(partition))
                parsed = IntervalSet.from_list(ivs)
                if parsed:
                    target.setdefault(key, IntervalSet()).update(parsed)
