"""Pulsar positions: message ids as int64 positions, and which ledgers' entries a partition holds.

:class:`PositionCodec` maps (ledger id, entry id) to a position (the position model in
sources/pulsar.py). :class:`LedgerRuns` keeps the runs the master reports (sources/positions.py),
from the committed ledger on.
A partition's managed ledger is a sequence of BookKeeper ledgers with increasing, not consecutive,
ids (ledger ids are global to the cluster: other topics' ledgers come between); the entries of one
ledger are dense from 0. Each ledger seen is one run ``[ledger << bits | first, ledger << bits | last + 1)``.
"""

from __future__ import annotations

from streamrover.sources.api import SourceError


class LedgerRuns:
    """Per partition id: ledger id -> [first entry, last entry] seen."""

    def __init__(self, entry_bits: int) -> None:
        self.entry_bits = entry_bits
        self._seen: dict[str, dict[int, list[int]]] = {}

    def see(self, pid: str, ledger: int, first: int, last: int | None = None) -> None:
        """Entries ``first..last`` (``last`` defaults to ``first``) of ``ledger`` hold messages."""
        last = first if last is None else last
        known = self._seen.setdefault(pid, {}).get(ledger)
        if known is None:
            self._seen[pid][ledger] = [first, last]
        else:
            known[0], known[1] = min(known[0], first), max(known[1], last)

    def forget_before(self, pid: str, ledger: int) -> None:
        """Forget the ledgers before ``ledger``: committed, the master folded their runs (else one per ledger stays)."""
        ledgers = self._seen.get(pid, {})
        for old in [lg for lg in ledgers if lg < ledger]:
            del ledgers[old]

    def newest(self, pid: str) -> tuple[int, int] | None:
        """(ledger id, last entry seen) of the newest ledger seen, or None."""
        ledgers = self._seen.get(pid)
        if not ledgers:
            return None
        ledger = max(ledgers)
        return ledger, ledgers[ledger][1]

    def runs(self, pid: str) -> tuple[tuple[int, int], ...]:
        """The runs of positions seen to hold messages, in order."""
        bits = self.entry_bits
        return tuple(
            (ledger << bits | first, ledger << bits | (last + 1))
            for ledger, (first, last) in sorted(self._seen.get(pid, {}).items())
        )


class PositionCodec:
    """(ledger id, entry id) <-> int64 position: ``ledger_id << entry_bits | entry_id``."""

    def __init__(self, entry_bits: int = 24) -> None:
        if not 16 <= entry_bits <= 40:
            raise SourceError(f"sr.entry_bits must be within 16..40, got {entry_bits}")
        self.entry_bits = entry_bits
        self.ledger_bits = 63 - entry_bits

    def encode(self, ledger_id: int, entry_id: int) -> int:
        """The position of entry ``entry_id`` of ledger ``ledger_id``; :class:`SourceError` when either does not fit
        its bits.
        """
        if not 0 <= entry_id < 1 << self.entry_bits:
            raise SourceError(
                f"Pulsar entry id {entry_id} (ledger {ledger_id}) does not fit in sr.entry_bits={self.entry_bits}: "
                "register the dataset with a larger sr.entry_bits"
            )
        if not 0 <= ledger_id < 1 << self.ledger_bits:
            raise SourceError(
                f"Pulsar ledger id {ledger_id} does not fit in {self.ledger_bits} bits (63 - sr.entry_bits="
                f"{self.entry_bits}): register the dataset with a smaller sr.entry_bits"
            )
        return ledger_id << self.entry_bits | entry_id

    def decode(self, position: int) -> tuple[int, int]:
        """(ledger id, entry id) of ``position``."""
        return position >> self.entry_bits, position & ((1 << self.entry_bits) - 1)
