"""The shard service's durable key-value store: compare-and-set over the journal (the rendezvous keeps its state here).

A part of the core (``ShardCore.kv``), not a mixin: it touches nothing but its journal rows
and one counter, ``kv_version_floor``.
"""

from __future__ import annotations

from streamrover.shard_service.api import InvalidArgumentError
from streamrover.shard_service.master.journal import Journal


class KvStore:
    """Versioned keys in the journal. Single-threaded: the server's lock serialises calls, as for the core."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version) of ``key``, or None when absent."""
        return self.journal.kv_get(key)

    def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        """(key, value) of every key that starts with ``prefix``, in key order (for the metrics)."""
        return self.journal.kv_scan(prefix)

    def set(self, key: str, value: bytes, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-set: write ``value`` if the key is at ``expected_version`` (0: absent).

        Returns (written, current value, current version). A key created (again) starts above every
        version a deleted key ever had, so a writer holding the version of a deleted key can never
        overwrite its successor. :class:`InvalidArgumentError` for an empty key.
        """
        if not key:
            raise InvalidArgumentError("a key is required")
        with self.journal.transaction():
            current = self.journal.kv_get(key)
            version = current[1] if current else 0
            if version != expected_version:
                return False, current[0] if current else b"", version
            new = version + 1 if current else int(self.journal.get_meta("kv_version_floor") or 0) + 1
            self.journal.kv_put(key, value, new)
        return True, value, new

    def delete_range(self, key: str, range_end: str) -> int:
        """Remove every key in ``[key, range_end)``, whatever its version. Returns how many were removed.

        :class:`InvalidArgumentError` unless ``key < range_end``. Versions are never reused, as for :meth:`delete`.
        """
        if not key or not range_end > key:
            raise InvalidArgumentError(
                f"a key range needs a key and a range end above it, got [{key!r}, {range_end!r})"
            )
        with self.journal.transaction():
            deleted, highest = self.journal.kv_delete_range(key, range_end)
            if deleted:
                floor = int(self.journal.get_meta("kv_version_floor") or 0)
                self.journal.put_meta("kv_version_floor", str(max(floor, highest)))
        return deleted

    def delete(self, key: str, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-delete: remove the key if it is at ``expected_version``; no row (tombstone) stays.

        Returns (deleted, current value, current version): ``(True, b"", 0)`` once gone.
        """
        if not key:
            raise InvalidArgumentError("a key is required")
        with self.journal.transaction():
            current = self.journal.kv_get(key)
            version = current[1] if current else 0
            if version != expected_version:
                return False, current[0] if current else b"", version
            if current:
                self.journal.kv_delete(key)
                floor = int(self.journal.get_meta("kv_version_floor") or 0)
                self.journal.put_meta("kv_version_floor", str(max(floor, version)))
        return True, b"", 0
