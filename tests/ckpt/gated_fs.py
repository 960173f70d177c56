"""An in-memory fsspec filesystem whose storage can misbehave on cue: reads that fail with EIO (a storage
blip), writes that block until released (a slow persist). For checkpoints with ``saver="thread"`` (the
saver shares this process, so it sees the same filesystem)."""

from __future__ import annotations

import errno
import threading
import uuid
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class GatedFS(MemoryFileSystem):
    """``srgated://ROOT``: memory storage. ``fail_reads``: the next N opens for reading raise EIO.
    ``gate``: while cleared, an open for writing blocks (``entered`` is set when one waits)."""

    protocol = "srgated"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]
    fail_reads = 0
    failed_reads = 0
    gate = threading.Event()
    entered = threading.Event()

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and GatedFS.fail_reads > 0:
            GatedFS.fail_reads -= 1
            GatedFS.failed_reads += 1
            raise OSError(errno.EIO, "Input/output error (injected storage blip)", path)
        if "w" in mode and not GatedFS.gate.is_set():
            GatedFS.entered.set()
            if not GatedFS.gate.wait(timeout=300):
                raise OSError(errno.ETIMEDOUT, "the test never opened the gate", path)
        return super()._open(path, mode, *args, **kwargs)

    @classmethod
    def reset(cls) -> str:
        """Healthy storage again; returns a fresh root URL."""
        cls.fail_reads = 0
        cls.failed_reads = 0
        cls.gate.set()
        cls.entered.clear()
        return f"srgated://ckpt-{uuid.uuid4().hex[:8]}"


fsspec.register_implementation("srgated", GatedFS, clobber=True)
