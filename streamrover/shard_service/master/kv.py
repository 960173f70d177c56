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

    def set(self, key: str, value: bytes, expected_version: int, writer: str = "") -> tuple[bool, bytes, int]:
        """Compare-and-set: write ``value`` if the key is at ``expected_version`` (0: absent).

        Returns (written, current value, current version). A key created (again) starts above every
        version a deleted key ever had, so a writer holding the version of a deleted key can never
        overwrite its successor. ``writer``: the write's id; a repeat of the write that made the current
        version (its answer was lost) is answered written. :class:`InvalidArgumentError` for an empty key.
        """
        if not key:
            raise InvalidArgumentError("a key is required")
        with self.journal.transaction():
            current = self.journal.kv_get(key)
            version = current[1] if current else 0
            if version != expected_version:
                written = bool(writer) and current is not None and self.journal.kv_writer(key) == (writer, version)
                return written, current[0] if current else b"", version
            new = version + 1 if current else int(self.journal.get_meta("kv_version_floor") or 0) + 1
            self.journal.kv_put(key, value, new)
            self.journal.kv_put_writer(key, writer, new)
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

    def delete(self, key: str, expected_version: int, writer: str = "") -> tuple[bool, bytes, int]:
        """Compare-and-delete: remove the key if it is at ``expected_version``; no row of it stays in ``kv``.

        Returns (deleted, current value, current version): ``(True, b"", 0)`` once gone. ``writer`` as for
        :meth:`set`: a repeat of the delete that removed it is answered deleted.
        """
        if not key:
            raise InvalidArgumentError("a key is required")
        with self.journal.transaction():
            current = self.journal.kv_get(key)
            version = current[1] if current else 0
            if version != expected_version:
                if writer and current is None and self.journal.kv_writer(key) == (writer, 0):
                    return True, b"", 0
                return False, current[0] if current else b"", version
            self.journal.kv_put_writer(key, writer, 0)
            if current:
                self.journal.kv_delete(key)
                floor = int(self.journal.get_meta("kv_version_floor") or 0)
                self.journal.put_meta("kv_version_floor", str(max(floor, version)))
        return True, b"", 0
