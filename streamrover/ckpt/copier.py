"""Chunked copies into a snapshot buffer, shared out dynamically between the calling thread and a helper.

A copy of tensors into shared memory is cut into chunks of :data:`CHUNK` bytes. Any thread that
calls :meth:`CopyJob.work` takes the next chunk not yet taken until none is left, so the work
is balanced at run time: a helper thread descheduled by other load on a busy 2-core machine
delays the copy by at most the one chunk it holds, where a statically split parallel copy
(``Tensor.copy_`` with 2 intra-op threads) waits for the whole half of the descheduled thread.
The copies are ctypes calls, which release the GIL, so the chunks really run in parallel with each
other and with the trainer's Python code: :func:`copy_nt` (non-temporal stores, ``_ntcopy.c``, built
with the package) where it was built, else ``ctypes.memmove``.

A job is started with a helper thread and then either finished at once by the caller
(:meth:`CopyJob.wait`, which helps with the chunks left: blocking saves) or left to the helper
while training goes on (overlapped saves); whoever waits later helps with what is left too.
The thread that completes the last chunk runs ``on_complete`` (publishing the snapshot header)
before the job counts as done, so a waiter returns only once the snapshot is visible.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

from streamrover.ckpt.api import CheckpointError

CHUNK = 4 << 20
NT_FROM = 256 << 10  # below this a copy may still be in the caches when read again: plain memmove
PREFAULT_STRIDE = 64 << 10  # one read fault maps this much of a tmpfs file (the kernel's default fault-around)
PREFAULT_FROM = 16 << 20  # a copy out of a mapping this large or larger has its source faulted in ahead


def _load_ext() -> ctypes.CDLL | None:
    """The built ``_ntcopy`` extension (the file the import system would load for this interpreter), or None if
    it is not built or ``STREAMROVER_NT_COPY=0``."""
    if os.environ.get("STREAMROVER_NT_COPY", "1") == "0":
        return None
    spec = importlib.util.find_spec("streamrover.ckpt._ntcopy")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.streamrover_copy_nt.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.streamrover_copy_nt.restype = None
        lib.streamrover_prefault.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.streamrover_prefault.restype = ctypes.c_uint64
    except (OSError, AttributeError):
        return None
    return lib


_EXT = _load_ext()
_NT: Callable[[int, int, int], Any] | None = _EXT.streamrover_copy_nt if _EXT is not None else None
_PREFAULT: Callable[[int, int, int], Any] | None = _EXT.streamrover_prefault if _EXT is not None else None
NT_AVAILABLE = _NT is not None


def copy_nt(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (no overlap), with non-temporal stores when large.

    Streaming stores skip the read-for-ownership of each destination cache line that a memcpy does:
    about 0.8x the time of glibc's memcpy for a large copy on the VMs measured (see ``_ntcopy.c``).
    """
    if _NT is not None and n >= NT_FROM:
        _NT(dst, src, n)
    else:
        ctypes.memmove(dst, src, n)


def _overlapping(ranges: list[tuple[int, int, int]]) -> bool:
    """Whether two of the ranges write the same destination bytes (their order then matters)."""
    spans = sorted((dst, dst + n) for dst, _, n in ranges if n)
    return any(b_start < a_end for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def copy_from_mapping(ranges: list[tuple[int, int, int]]) -> None:
    """Copy ``(dst_address, src_address, nbytes)`` ranges out of a freshly mapped snapshot buffer.

    A fresh mapping of 1 GiB is 16,384 page faults (the kernel maps a tmpfs file's pages 16 at a time), over half
    as long as the copy itself; taken inside the copy, they serialise with it. Here a second thread takes them
    ahead of the copy (``streamrover_prefault`` of the C extension, one read per :data:`PREFAULT_STRIDE`, no
    GIL) while the caller copies behind it with non-temporal stores, then helps with the chunks left. 1 GiB into
    a built model: 0.057-0.065 s, against 0.079-0.091 s for ``load_state_dict``'s ``Tensor.copy_`` (2 intra-op
    threads faulting as they go) on the 2-core VMs measured. Ranges that write the same bytes are copied by
    the caller alone, in order, so the later wins as with successive ``copy_`` calls.
    """
    job = CopyJob(ranges, [])
    ahead = None
    if _PREFAULT is not None and job.nbytes >= PREFAULT_FROM:
        prefault = _PREFAULT
        helps = not _overlapping(ranges)  # two threads copy in no set order

        def run() -> None:
            for _, src, n in ranges:
                prefault(src, n, PREFAULT_STRIDE)
            if helps:
                job.work()

        ahead = threading.Thread(target=run, name="ckpt-prefault", daemon=True)
        ahead.start()
    try:
        job.wait()
    finally:
        if ahead is not None:
            ahead.join()  # it reads the source mapping: the caller may unmap it once this returns


# The raw copy, a module attribute so that a test can inject a failure into it.
_memmove: Callable[[int, int, int], Any] = copy_nt


def file_writer(fd: int) -> Callable[[int, int, int], None]:
    """A chunk copy that writes ``n`` bytes at address ``src`` to offset ``dst`` of file ``fd`` (``pwrite``).

    Into a ``/dev/shm`` file not mapped yet this is about twice as fast as a copy through a fresh mapping:
    the kernel allocates each page and copies into it, with no page fault per 4 KiB page and no zeroing of
    pages that are written whole. A full ``/dev/shm`` is an ``OSError`` (ENOSPC) here, never a SIGBUS. Writes
    to one tmpfs file take its inode lock one at a time, so a first save's split buffer (``shm.SPLIT_FROM``)
    has one writer per file, on its own thread (``memory._pwrite_files``).
    """

    def write(dst: int, src: int, n: int) -> None:
        view = memoryview((ctypes.c_char * n).from_address(src)).cast("B")
        done = 0
        while done < n:  # os.pwrite releases the GIL; a short write (a signal) continues where it stopped
            done += os.pwrite(fd, view[done:], dst + done)

    return write


class CopyError(CheckpointError):
    """A chunk copy or the completion step of a :class:`CopyJob` failed."""


class CopyJob:
    """Copy ``(dst_address, src_address, nbytes)`` ranges; ``keep`` holds the objects that own those addresses.

    ``copy(dst, src, n)`` copies one chunk (default: ``memmove``; :func:`file_writer` takes file offsets as ``dst``).

    ``keep`` is dropped once the job is done, so the buffers it exported can be unmapped.
    """

    def __init__(
        self,
        ranges: list[tuple[int, int, int]],
        keep: list[Any],
        on_complete: Callable[[], None] | None = None,
        chunk: int = CHUNK,
        copy: Callable[[int, int, int], Any] | None = None,
    ) -> None:
        self._chunks: list[tuple[int, int, int]] = []
        for dst, src, n in ranges:
            for off in range(0, n, chunk):
                self._chunks.append((dst + off, src + off, min(chunk, n - off)))
        self._keep: list[Any] | None = keep
        self._copy = copy  # None: _memmove, looked up at each chunk (a test may replace it meanwhile)
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self._next = 0
        self._running = 0
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.nbytes = sum(n for _, _, n in ranges)
        if not self._chunks:
            self._finish()

    @property
    def chunks(self) -> int:
        """How many chunks the copy is cut into."""
        return len(self._chunks)

    def start(self, helpers: int = 1, name: str = "ckpt-copy") -> None:
        """Start ``helpers`` threads working on the chunks (daemons: a dying process never waits for them)."""
        for i in range(helpers if not self._done.is_set() else 0):
            threading.Thread(target=self.work, name=f"{name}-{i}", daemon=True).start()

    def work(self) -> None:
        """Copy chunks until none is left to take (or one failed); the last one out completes the job."""
        while True:
            with self._lock:
                if self.error is not None or self._next >= len(self._chunks):
                    return
                dst, src, n = self._chunks[self._next]
                self._next += 1
                self._running += 1
            failed: BaseException | None = None
            try:
                (self._copy or _memmove)(dst, src, n)
            except BaseException as exc:  # surfaced to whoever waits; the snapshot is never published
                failed = exc
            with self._lock:
                self._running -= 1
                if failed is not None and self.error is None:
                    self.error = failed
                last = self._running == 0 and (self.error is not None or self._next >= len(self._chunks))
                if last and self._done.is_set():
                    last = False
            if last:
                self._finish()

    def _finish(self) -> None:
        try:
            if self.error is None and self._on_complete is not None:
                self._on_complete()
        except BaseException as exc:  # publishing failed: the waiter reports it
            self.error = exc
        finally:
            self._keep = None
            self._done.set()

    def done(self) -> bool:
        """Whether every chunk is copied (or the copy failed)."""
        return self._done.is_set()

    def wait(self, help: bool = True) -> None:
        """Help with the chunks left (if ``help``), wait until the job is done; raise :class:`CopyError` on failure."""
        if help:
            self.work()
        self._done.wait()
        if self.error is not None:
            raise CopyError(f"{type(self.error).__name__}: {self.error}") from self.error
