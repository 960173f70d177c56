"""The master's polls of a Kafka topic: what a poll asks the brokers, and what it keeps from the polls before.

A poll reports every partition of the topic with its end offset and its earliest one (``KafkaSource.poll``). On a
topic of 10,000 partitions, asking all of that at every poll (100 ms apart) was most of what the master spent
beyond a small topic's cost (issue 32), and most of those partitions had not moved. So a poll asks:

- the topic's partition listing and the partitions' earliest offsets at most once per ``LISTED_PER_SECOND``
  partitions a second (at every poll below a thousand partitions, every 10 s at 10,000). A listing is 100-300
  ms of the master's CPU in one call at 10,000 partitions (10,000 metadata objects): at every poll it stalled
  the master's threads about once a second (lease p99 128-378 ms at W = 1,000);
- the ends of the partitions whose end moved in the last ``MOVED_SECONDS``, at every poll;
- the ends of the others (idle) in turn: each at least once per ``IDLE_SECONDS`` (at every poll when the polls
  are that far apart), and at least ``IDLE_CHUNK`` a poll (one ListOffsets request's worth), so a topic of up
  to that many partitions is asked whole at every poll. The first new record of a partition idle for
  ``MOVED_SECONDS`` is seen up to ``IDLE_SECONDS`` after it was written (at 10,000 partitions; sooner on smaller
  topics), and the lag shown for an idle partition is at most that old; a partition that moved is seen at the
  next poll.

A partition that was not asked keeps its last end, and a partition whose offsets did not change keeps its
``Partition`` object (building 10,000 of them took ~10 ms a poll). A poll that fails forgets the listing and
the earliest offsets (the next poll lists again, so a deleted topic is told as gone); the ends it knows stay.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from streamrover.sources.api import Partition, SourceError, SourceUnavailableError

#: partitions a second whose listing and earliest offsets a poll asks again (see the module docstring)
LISTED_PER_SECOND = 1000
#: seconds after its end last moved that a partition's end is still asked at every poll
MOVED_SECONDS = 10.0
#: seconds within which every idle partition's end is asked once (polls that far apart ask them all)
IDLE_SECONDS = 1.0
#: idle partitions a poll asks at least (kafka_client.OFFSETS_CHUNK: one request's worth)
IDLE_CHUNK = 250


class TopicPolls:
    """The polls of one topic: ``listing()`` gives its partition numbers (sorted), ``ends(numbers)`` and
    ``earliest(numbers)`` the end and earliest offset of each of ``numbers``; each raises :class:`SourceError`
    when it cannot say."""

    def __init__(
        self,
        topic: str,
        listing: Callable[[], list[int]],
        ends: Callable[[list[int]], dict[int, int]],
        earliest: Callable[[list[int]], dict[int, int]],
        listed_per_second: float = LISTED_PER_SECOND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topic
        self._listing, self._ask_ends, self._ask_earliest, self._clock = listing, ends, earliest, clock
        self.listed_per_second = listed_per_second
        self._listed: tuple[float, list[int]] | None = None  # until when the listing holds, the partition numbers
        self._row: dict[int, int] = {}  # partition number -> its index in the listing
        self._earliest: dict[int, int] | None = None  # asked again with the next listing
        self._ends: dict[int, int] = {}  # the last end asked of each partition
        self._moved: dict[int, float] = {}  # partitions whose end moved in the last MOVED_SECONDS: when it last did
        self._unasked: set[int] = set()  # partitions of the listing whose end was never asked
        self._turn = 0  # where in the listing the next poll's idle partitions start
        self._last: float | None = None  # when the last poll asked
        self._parts: list[Partition] = []  # what the last poll reported, in listing order

    def poll(self) -> list[Partition]:
        """Every partition of the topic with its end and earliest offsets (see the module docstring)."""
        now = self._clock()
        fresh = self._listed is None or now >= self._listed[0]
        numbers = self._list(now) if fresh else self._listed[1]  # type: ignore[index]  # (not None: not fresh)
        try:
            asked = self._due(numbers, now)
            ends = self._ask_ends(asked)
            unanswered = self._unasked.difference(ends)  # (a partition asked before keeps its last end)
            if unanswered:
                raise SourceUnavailableError(f"no end offset of {self.topic!r} partition(s) {sorted(unanswered)}")
            if self._earliest is None:
                self._earliest = self._ask_earliest(numbers)
        except SourceError:
            self._listed = self._earliest = None  # the next poll lists the partitions again (a deleted topic is told)
            raise
        self._last = now
        earliest, row, parts = self._earliest, self._row, self._parts
        for n in ends.keys() if not fresh else numbers:  # (a new listing: every earliest offset may have changed)
            old = self._ends.get(n)
            end, first = ends[n] if n in ends else old, earliest[n]  # (each partition was asked or is known)
            if end != old:
                if old is not None:
                    self._moved[n] = now
                self._ends[n] = end  # type: ignore[assignment]
            part = parts[row[n]]
            if part.end != end or part.earliest != first:
                parts[row[n]] = Partition(part.id, first, end, earliest=first)  # type: ignore[arg-type]
        self._unasked.difference_update(ends)
        return list(parts)

    def _list(self, now: float) -> list[int]:
        """List the topic's partitions again; forget what is known of partitions no longer in it."""
        numbers = self._listing()
        self._listed, self._earliest = (now + len(numbers) / self.listed_per_second, numbers), None
        known = {p.id: p for p in self._parts}
        self._row = {n: i for i, n in enumerate(numbers)}
        self._ends = {n: e for n, e in self._ends.items() if n in self._row}
        self._moved = {n: t for n, t in self._moved.items() if n in self._row}
        self._unasked = {n for n in numbers if n not in self._ends}
        # a placeholder for a partition never asked: -1 offsets, replaced before the poll returns
        self._parts = [known.get(f"{self.topic}-{n}") or Partition(f"{self.topic}-{n}", -1, -1) for n in numbers]
        return numbers

    def _due(self, numbers: list[int], now: float) -> list[int]:
        """The partitions whose end this poll asks: those that moved lately, never asked, and idle ones in turn."""
        for n, when in list(self._moved.items()):
            if now - when > MOVED_SECONDS:
                del self._moved[n]
        since = math.inf if self._last is None else now - self._last
        idle = max(IDLE_CHUNK, math.ceil(len(numbers) * min(since / IDLE_SECONDS, 1.0) - 1e-6))  # (0.1 s: 1000)
        if idle + len(self._moved) + len(self._unasked) >= len(numbers):
            self._turn = 0
            return numbers
        start, self._turn = self._turn % len(numbers), (self._turn + idle) % len(numbers)
        turn = numbers[start : start + idle] + numbers[: max(0, start + idle - len(numbers))]
        return sorted(set(turn).union(self._moved, self._unasked))


__all__ = ["IDLE_CHUNK", "IDLE_SECONDS", "LISTED_PER_SECOND", "MOVED_SECONDS", "TopicPolls"]
