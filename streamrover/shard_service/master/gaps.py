"""Commit gaps of staged datasets: a commit that a later one of the same (producer, part) says came before it.

A sink's commit may name the epoch of its (producer, part)'s commit right before it (``previous_epoch`` in
``CommitStagedRequest``: Flink's subtask's previous checkpoint that staged files, Spark's batch id - 1). When
that epoch is not committed, the missing commit is a *gap*. It may still come: Flink retries an earlier
checkpoint's commit after a later one landed, a restore replays older commits. So a gap is only loss once it
stayed open longer than the dataset's bound (``sr.commit_gap_ms``, 15 minutes by default, generous
against Flink's committer retries and job restarts). Then:

- ``sr.on_data_loss=fail`` (the default): the dataset fails, naming the producer, part and epoch; resuming it
  gives the commit one more bound to arrive (``--skip-lost``: the open gaps are accounted as skipped instead);
- ``sr.on_data_loss=skip``: the gap is marked skipped: counted in status and ``/metrics``, the dataset goes on.

A gap closes (skipped or not) when its commit arrives. Gaps are journalled (opened at, skipped), so a
restarted master keeps their ages. A commit that names no previous epoch (the first of its (producer, part),
or one whose sink cannot know it) opens no gap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.staged import COMMIT_GAP_MS, DEFAULT_GAP_MS, gap_bound_ms

log = logging.getLogger(__name__)

#: (dataset, producer, part, missing epoch)
GapKey = tuple[str, str, str, int]


@dataclass
class Gap:
    """An open gap: ``epoch`` of (producer, part) is missing, though ``next_epoch`` names it as its previous."""

    dataset: str
    producer: str
    part: str
    epoch: int
    next_epoch: int
    opened_at: float  # the master's clock when next_epoch's commit opened it (or when a resume restarted it)
    skipped: bool = False

    @property
    def key(self) -> GapKey:
        return (self.dataset, self.producer, self.part, self.epoch)

    def describe(self) -> str:
        return (
            f"the commit of producer {self.producer!r}, part {self.part!r}, epoch {self.epoch} never arrived, "
            f"though epoch {self.next_epoch} of the same producer and part names it as its previous"
        )


class CommitGaps:
    """The open gaps of every staged dataset (journalled); the caller holds the service lock."""

    def __init__(self, journal: Journal, clock: Callable[[], float]) -> None:
        self.journal = journal
        self.clock = clock
        self.open: dict[GapKey, Gap] = {}
        for row in journal.load_gaps():
            gap = Gap(*row)
            self.open[gap.key] = gap

    def of(self, dataset: str) -> list[Gap]:
        """The dataset's open gaps, oldest first."""
        return sorted((g for g in self.open.values() if g.dataset == dataset), key=lambda g: (g.opened_at, g.key))

    def committed(self, dataset: str, producer: str, part: str, epoch: int, previous: int | None,
                  is_committed: Callable[[GapKey], bool]) -> None:  # fmt: skip
        """A commit of the key was journalled (call inside its transaction): close its gap, open the one before."""
        gap = self.open.pop((dataset, producer, part, epoch), None)
        if gap is not None:
            self.journal.delete_gap(dataset, producer, part, epoch)
            log.info("dataset %s: the gap at %s/%s epoch %d closed after %.1f s%s", dataset, producer, part, epoch,
                     self.clock() - gap.opened_at, " (it had been skipped)" if gap.skipped else "")  # fmt: skip
        if previous is None or (dataset, producer, part, previous) in self.open:
            return
        if is_committed((dataset, producer, part, previous)):
            return
        gap = Gap(dataset, producer, part, previous, epoch, self.clock())
        self.open[gap.key] = gap
        self.journal.put_gap(dataset, producer, part, previous, epoch, gap.opened_at, False)
        log.warning("dataset %s: %s/%s committed epoch %d before its previous epoch %d: waiting for that commit",
                    dataset, producer, part, epoch, previous)  # fmt: skip

    def due(self, bound: Callable[[str], float | None]) -> list[Gap]:
        """Gaps not yet skipped and open longer than their dataset's ``bound`` (seconds; None: not checked)."""
        now = self.clock()
        out = []
        for gap in self.open.values():
            limit = None if gap.skipped else bound(gap.dataset)
            if limit is not None and now - gap.opened_at > limit:
                out.append(gap)
        return sorted(out, key=lambda g: (g.opened_at, g.key))

    def next_deadline(self, bound: Callable[[str], float | None]) -> float | None:
        """When the next gap not yet skipped passes its bound (None when none can)."""
        times = []
        for gap in self.open.values():
            limit = None if gap.skipped else bound(gap.dataset)
            if limit is not None:
                times.append(gap.opened_at + limit)
        return min(times) if times else None

    def skip(self, gap: Gap) -> None:
        """Account the gap as skipped (in the caller's transaction): it stays shown, no longer checked."""
        gap.skipped = True
        self.journal.put_gap(gap.dataset, gap.producer, gap.part, gap.epoch, gap.next_epoch, gap.opened_at, True)

    def restart(self, dataset: str, skip: bool) -> int:
        """A failed dataset resumed (in the caller's transaction): its open gaps are skipped (``skip``) or get one
        more bound to close, from now. Returns how many changed."""
        changed = 0
        for gap in self.of(dataset):
            if gap.skipped:
                continue
            if skip:
                self.skip(gap)
            else:
                gap.opened_at = self.clock()
                self.journal.put_gap(dataset, gap.producer, gap.part, gap.epoch, gap.next_epoch, gap.opened_at, False)
            changed += 1
        return changed

    def forget_dataset(self, dataset: str) -> None:
        """Forget the dataset's gaps (it was removed; the caller deletes its journal rows)."""
        for key in [k for k in self.open if k[0] == dataset]:
            del self.open[key]


def gaps_to_pb(gaps: list[Gap], now: float) -> list[pb.CommitGap]:
    """The gaps as ``DatasetInfo.commit_gaps``, their ages at ``now``."""
    out = []
    for g in gaps:
        age = max(now - g.opened_at, 0.0)
        out.append(pb.CommitGap(producer=g.producer, part=g.part, epoch=g.epoch, next_epoch=g.next_epoch,
                                age_seconds=age, skipped=g.skipped))  # fmt: skip
    return out


__all__ = ["COMMIT_GAP_MS", "DEFAULT_GAP_MS", "CommitGaps", "Gap", "gap_bound_ms", "gaps_to_pb"]
