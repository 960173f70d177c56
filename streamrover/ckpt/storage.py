"""Where checkpoints are persisted: a local directory (default) or any fsspec URL.

Every file is written under a temporary name and renamed into place; on local disk it
is fsync'd first and its directory after, so a file that exists under its final name
is complete. S3 (``s3://``) has no rename (a "move" is a copy of every byte), but its
uploads are atomic: an object appears whole when its (multipart) upload completes, or not
at all, so there files are uploaded under their final name (``s3_upload.py``) and a failed
upload is aborted. Checksums are computed while writing, on a second core.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from streamrover.ckpt.api import StorageUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Reads that fail with an I/O error are retried this many times in all, the waits doubling from
#: READ_BACKOFF seconds (0.25 + 0.5 + 1 + 2 + 4: a blip of up to ~8 s is ridden out).
READ_ATTEMPTS = 6
READ_BACKOFF = 0.25
#: Errors that say what is on storage (a missing or misplaced file), not that storage failed: never retried.
_ANSWERS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)

CHECKSUM_ALGO = "crc32"  # zlib, ~4 GB/s on one core; "sha256" (or any hashlib name) on request


class Hasher(Protocol):
    """What a checksum needs of a hash: :mod:`hashlib`'s interface."""

    def update(self, data: Any, /) -> None:
        """Hash ``data`` (bytes-like) after what was hashed so far."""

    def hexdigest(self) -> str:
        """The digest of everything hashed, in hex."""


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algo: str) -> Hasher:
    """A hasher for ``algo`` (``crc32`` or any :mod:`hashlib` name)."""
    if algo == "crc32":
        return _Crc32()
    return hashlib.new(algo)


def checksum(data: Any, algo: str = CHECKSUM_ALGO) -> str:
    """``algo:hexdigest`` of ``data``."""
    h = new_hasher(algo)
    h.update(data)
    return f"{algo}:{h.hexdigest()}"


class _ParallelHasher:
    """Hashes chunks on another thread while the caller writes them (hashlib releases the GIL).

    An error on the hashing thread is raised to the caller (by its next :meth:`update` or by :meth:`result`); the
    thread then drains what is queued, so the caller never blocks on a queue nobody reads."""

    def __init__(self, algo: str, pause: Callable[[], object] | None = None) -> None:
        self.algo = algo
        self._pause = pause
        self._hasher = new_hasher(algo)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (chunk := self._queue.get()) is not None:
                if self._pause is not None:
                    self._pause()
                self._hasher.update(chunk)
        except BaseException as exc:  # handed to the caller; keep reading so its puts return
            self._error = exc
            while self._queue.get() is not None:
                pass

    def update(self, chunk: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(chunk)

    def result(self, quiet: bool = False) -> str:
        """The checksum of what was hashed; the hashing thread's error is raised unless ``quiet`` (the caller is
        failing already: its own error is the one to raise)."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None and not quiet:
            raise self._error
        return f"{self.algo}:{self._hasher.hexdigest()}"


CHUNK = 32 << 20
WRITE_CHUNK = 8 << 20  # local writes: a pause is honoured within ~3 ms
#: fsspec protocols uploaded in place (atomic: a completed PUT or multipart upload, or nothing; s3fs's API).
ATOMIC_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a"})


def _chunks(parts: Iterable[Any], pause: Callable[[], object] | None = None) -> Iterable[memoryview]:
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), CHUNK):
            if pause is not None:
                pause()
            yield view[start : start + CHUNK]


class Storage:
    """A checkpoint root: a local directory or an fsspec URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.read_attempts = READ_ATTEMPTS
        self.read_backoff = READ_BACKOFF
        if "://" in url:
            import fsspec

            self.protocol = protocol = url.split("://", 1)[0]
            self.fs: Any = fsspec.filesystem(protocol, **self.storage_options)
            self.root = url
            self.local = False
            self.atomic_uploads = protocol in ATOMIC_UPLOAD_PROTOCOLS
        else:
            self.protocol = "file"
            self.fs = None
            self.root = os.path.abspath(url)
            self.local = True
            self.atomic_uploads = False

    def join(self, *parts: str) -> str:
        """The path of ``parts`` under the storage root."""
        if self.local:
            return os.path.join(self.root, *parts)
        return "/".join([self.root.rstrip("/"), *parts])

    # -- writes ------------------------------------------------------------------
    def write(
        self, path: str, parts: Iterable[Any], algo: str = CHECKSUM_ALGO, pause: Callable[[], object] | None = None
    ) -> tuple[int, str]:
        """Write the concatenation of ``parts`` atomically to ``path``; return (bytes, checksum).

        ``pause()`` is called before every few MiB written or hashed; it may block to yield the CPU and memory
        bandwidth to something more urgent (the saver: a trainer's save in progress).
        """
        hasher = _ParallelHasher(algo, pause)
        if self.atomic_uploads:
            return self._upload(path, _chunks(parts, pause), hasher)
        tmp = self._tmp_name(path)
        written = 0
        try:
            if self.local:
                parent = os.path.dirname(path)
                if not os.path.isdir(parent):
                    os.makedirs(parent, exist_ok=True)
                    self._fsync_dir(os.path.dirname(parent))  # the new directory's entry is durable too
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for chunk in _chunks(parts):
                        hasher.update(chunk)
                        for start in range(0, len(chunk), WRITE_CHUNK):
                            if pause is not None:
                                pause()
                            view = chunk[start : start + WRITE_CHUNK]
                            while view:
                                n = os.write(fd, view)
                                view = view[n:]
                        written += len(chunk)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                digest = hasher.result()  # before the rename: a failed checksum leaves nothing at path
                os.replace(tmp, path)
                self._fsync_dir(os.path.dirname(path))
            else:
                self.fs.makedirs(self._parent(path), exist_ok=True)
                with self.fs.open(tmp, "wb") as fh:
                    for chunk in _chunks(parts, pause):
                        hasher.update(chunk)
                        fh.write(chunk)
                        written += len(chunk)
                digest = hasher.result()
                self.fs.mv(tmp, path)
        except BaseException:
            hasher.result(quiet=True)
            self._remove_quietly(tmp)
            raise
        return written, digest

    def _upload(self, path: str, parts: Iterable[Any], hasher: _ParallelHasher) -> tuple[int, str]:
        """Upload to S3 under the final name (``ckpt/s3_upload.py``): the object exists once its multipart upload
        completes; a failure aborts the upload, so no partial object is ever visible at ``path``."""
        from streamrover.ckpt import s3_upload

        part_size = max(int(self.fs.default_block_size), 5 << 20)
        try:
            written = s3_upload.upload(
                self.fs, path, _chunks(parts), hasher, part_size=part_size, concurrency=int(self.fs.max_concurrency)
            )
        except BaseException:
            hasher.result(quiet=True)
            raise
        return written, hasher.result()

    def write_bytes(self, path: str, data: bytes, algo: str = CHECKSUM_ALGO) -> str:
        """Write ``data`` atomically to ``path``; return its checksum."""
        return self.write(path, [data], algo)[1]

    def _tmp_name(self, path: str) -> str:
        head, _, name = path.rpartition("/")
        return f"{head}/.{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @staticmethod
    def _parent(path: str) -> str:
        return path.rpartition("/")[0]

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _remove_quietly(self, path: str) -> None:
        try:
            if self.local:
                os.unlink(path)
            elif self.fs.exists(path):
                self.fs.rm(path)
        except OSError:
            pass

    # -- reads -------------------------------------------------------------------
    def _retried(self, what: str, path: str, call: Callable[[], T]) -> T:
        """``call()``, retried with backoff on I/O errors; :class:`StorageUnavailableError` once they persist.

        A missing file is an answer, not a failure (``FileNotFoundError`` is raised at once).
        """
        delay = self.read_backoff
        for attempt in range(1, self.read_attempts + 1):
            try:
                return call()
            except _ANSWERS:
                raise
            except OSError as exc:
                if attempt == self.read_attempts:
                    raise StorageUnavailableError(
                        f"checkpoint storage failed to {what} {path} {attempt} times over "
                        f"~{self.read_backoff * (2 ** (attempt - 1) - 1):.1f} s: {exc}; no checkpoint was skipped"
                    ) from exc
                log.warning("checkpoint storage: %s %s failed (%s); retrying in %.2f s", what, path, exc, delay)
                time.sleep(delay)  # backoff between retries of a failed I/O call
                delay *= 2
        raise AssertionError("unreachable")

    def read(self, path: str) -> bytearray:
        """The whole file, in a writable buffer (tensors are built on it without copying). I/O errors are retried
        with backoff (:class:`StorageUnavailableError` if they last); a missing file raises ``FileNotFoundError``."""
        return self._retried("read", path, lambda: self._read(path))

    def _read(self, path: str) -> bytearray:
        if self.local:
            with open(path, "rb", buffering=0) as fh:
                size = os.fstat(fh.fileno()).st_size
                out = bytearray(size)
                view = memoryview(out)
                got = 0
                while got < size:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise OSError(f"{path} shrank while being read")
                    got += n
                return out
        self.fs.invalidate_cache(path)  # another process (the saver) may have written it: no stale listing
        with self.fs.open(path, "rb") as fh:
            return bytearray(fh.read())

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists; an I/O error is retried, not taken for "no" (``os.path.exists`` would)."""
        return self._retried("stat", path, lambda: self._exists(path))

    def _exists(self, path: str) -> bool:
        if self.local:
            try:
                os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) in directory ``path``; empty if it does not exist. I/O errors are retried."""
        return self._retried("list", path, lambda: self._listdir(path))

    def _listdir(self, path: str) -> list[str]:
        if self.local:
            try:
                return sorted(os.listdir(path))
            except FileNotFoundError:
                return []
        self.fs.invalidate_cache(path)
        if not self.fs.exists(path):
            return []
        return sorted(p.rstrip("/").rpartition("/")[2] for p in self.fs.ls(path, detail=False))

    def remove(self, path: str) -> None:
        """Remove file ``path``; a file already gone (or a failure to remove it) is ignored."""
        self._remove_quietly(path)

    def remove_tree(self, path: str) -> None:
        """Remove directory ``path`` and everything under it; gone already is fine."""
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)
