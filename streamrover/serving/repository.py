"""A model repository on a local directory or an fsspec URL: versions, atomic publish, retirement, retention.

The layout and the rules are in :mod:`streamrover.serving.api`. One exporter writes a model name at a
time (the job's rank 0); readers (servers, :func:`read_tables`) only trust versions whose ``lineage.json``
exists.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

from streamrover.ckpt.storage import Storage
from streamrover.serving.api import (
    CONFIG_FILE,
    DELTA_FILE,
    LINEAGE,
    TABLES_FILE,
    BrokenChainError,
    ServingError,
    VersionInfo,
)

log = logging.getLogger(__name__)
_TMP = ".tmp-"


class ModelRepository:
    """The versions of one model name under a repository root."""

    def __init__(self, root: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage = Storage(root, storage_options)
        self.name = name
        self.model_dir = self.storage.join(name)

    def path(self, *parts: str) -> str:
        """The path of ``parts`` under this model's directory."""
        return self.storage.join(self.name, *parts)

    # -- reading -------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Complete versions (their ``lineage.json`` exists), ascending."""
        out = []
        for entry in self.storage.listdir(self.model_dir):
            if entry.isdigit() and self.storage.exists(self.path(entry, LINEAGE)):
                out.append(int(entry))
        return sorted(out)

    def info(self, version: int) -> VersionInfo:
        """Version ``version``'s ``lineage.json``; :class:`ServingError` if it is not published."""
        try:
            doc = json.loads(bytes(self.storage.read(self.path(str(version), LINEAGE))))
        except FileNotFoundError as exc:
            raise ServingError(f"{self.name}: version {version} is not published in {self.storage.root}") from exc
        return VersionInfo.from_json(doc)

    def read(self, version: int, file: str) -> bytes:
        """The bytes of ``file`` of ``version``."""
        return bytes(self.storage.read(self.path(str(version), file)))

    def chain(self, version: int) -> list[VersionInfo]:
        """Version ``version`` and its ancestors down to its base (or full export), base first.

        Each delta names its parent; the chain is followed from ``version`` back, so a delta of an
        abandoned timeline (retired, or never a parent of this one) is never part of it."""
        chain: list[VersionInfo] = []
        current: int | None = version
        while current is not None:
            try:
                info = self.info(current)
            except ServingError as exc:
                raise BrokenChainError(
                    f"{self.name}: version {version} needs version {current}, which is not published ({exc})"
                ) from exc
            chain.append(info)
            current = info.parent
            if len(chain) > 100_000:
                raise BrokenChainError(f"{self.name}: version {version}'s chain does not end in a base")
        return chain[::-1]

    # -- writing -------------------------------------------------------------------
    def ensure_config(self, text: str) -> None:
        """Write ``NAME/config.pbtxt`` unless it holds ``text`` already."""
        path = self.path(CONFIG_FILE)
        if self.storage.exists(path) and bytes(self.storage.read(path)).decode() == text:
            return
        self.storage.write_bytes(path, text.encode())

    def publish(self, info: VersionInfo, files: dict[str, bytes]) -> bool:
        """Publish ``files`` and ``info`` as version ``info.version``; False (nothing written) if it exists.

        Local: written into a temporary directory beside it, fsync'd, renamed into place. Object stores:
        the files in place, ``lineage.json`` last."""
        version = str(info.version)
        if self.storage.exists(self.path(version, LINEAGE)):
            return False
        info.exported_at = time.time()
        lineage = json.dumps(info.to_json(), sort_keys=True, indent=1).encode()
        if not self.storage.local:
            for file, data in files.items():
                self.storage.write_bytes(self.path(version, file), data)
            self.storage.write_bytes(self.path(version, LINEAGE), lineage)
            return True
        tmp = self.path(f"{_TMP}{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        for file, data in {**files, LINEAGE: lineage}.items():
            self.storage.write_bytes(os.path.join(tmp, file), data)  # each fsync'd, and the directory
        final = self.path(version)
        if os.path.isdir(final):  # an unpublished leftover (no lineage.json): retired or cut short
            self.storage.remove_tree(final)
        try:
            os.rename(tmp, final)
        except OSError:  # published by someone else meanwhile (ENOTEMPTY/EEXIST): theirs stands
            self.storage.remove_tree(tmp)
            if self.storage.exists(self.path(version, LINEAGE)):
                return False
            raise
        self.storage._fsync_dir(self.model_dir)
        return True

    def unpublish(self, version: int) -> None:
        """Remove version ``version``: its ``lineage.json`` first (never a half-deleted version), then the rest."""
        self.storage.remove(self.path(str(version), LINEAGE))
        self.storage.remove_tree(self.path(str(version)))

    def clean_temporaries(self) -> int:
        """Remove temporary directories of publishes cut short (an exporter killed mid-publish); their count."""
        removed = 0
        for entry in self.storage.listdir(self.model_dir):
            if entry.startswith(_TMP):
                self.storage.remove_tree(self.path(entry))
                removed += 1
        return removed

    def retire_after(self, step: int) -> list[int]:
        """Unpublish every version above ``step`` (a trainer resumed from ``step``), newest first; returns them."""
        retired = [v for v in self.versions() if v > step][::-1]
        for v in retired:
            self.unpublish(v)
        if retired:
            log.warning("%s: versions %s retired: training resumed from step %d, they belong to an abandoned "
                        "timeline", self.name, retired[::-1], step)  # fmt: skip
        return retired[::-1]

    def apply_retention(self, keep_last: int) -> list[int]:
        """Keep the newest ``keep_last`` versions and every version their chains need; remove the rest."""
        versions = self.versions()
        keep: set[int] = set()
        for v in versions[-keep_last:]:
            keep.update(i.version for i in self.chain(v))
        dropped = [v for v in versions if v not in keep]
        for v in dropped:
            self.unpublish(v)
        return dropped


def version_files(info: VersionInfo) -> list[str]:
    """The data files a version of ``info.kind`` holds besides ``model.onnx`` and ``lineage.json``."""
    return {"base": [TABLES_FILE], "delta": [DELTA_FILE]}.get(info.kind, [])


__all__ = ["ModelRepository", "version_files"]
