"""One POSIX shared-memory snapshot buffer: allocation, pre-faulting, and its seqlock header.

Layout of a buffer (all integers little-endian)::

    0      8      16             24           32       36    40            48      56    4096
    | magic | gen | header_offset | header_len | hdr_crc | ... | pause_until | split | ... | tensor data | header JSON |

``gen`` is a seqlock generation: odd while a snapshot is being written, even once it
is complete. A writer sets it odd, copies the tensors, writes the header JSON and its
offset/length/CRC, then sets it even. A reader takes ``gen``, reads the header, and
re-reads ``gen``: the snapshot is valid only if both reads are equal and even. A
trainer killed mid-copy leaves ``gen`` odd, so its torn snapshot is never used.

``pause_until`` (``CLOCK_MONOTONIC`` nanoseconds, 0: none) asks a saver persisting this buffer to stop
reading it until then: the trainer sets it on its other buffers while it copies a new snapshot, so the
copy has the node's cores and memory bandwidth to itself, and clears it when done. A trainer that dies
mid-copy leaves a deadline that passes by itself.

``split`` (0: none) says the buffer is two files: its bytes from ``split`` on are the pages of a second file,
``NAME-tail``, mapped right after the first's (``MAP_FIXED``), so every reader still sees one contiguous buffer.
A large buffer created for a first save is split (:data:`SPLIT_FROM`): writes to one tmpfs file take its inode
lock, so two threads ``pwrite`` a new buffer in parallel only into two files (1 GiB: 0.22 s against 0.40 s).

Buffers live in ``/dev/shm`` (Linux POSIX shm) under a deterministic name, so a
restarted trainer or the saver can open them by name; they outlive the process that
created them until :meth:`SharedBuffer.unlink`. No ``multiprocessing.shared_memory``:
its resource tracker unlinks segments when their creator dies, which is exactly when
they are needed.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import struct
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from streamrover._libc import madvise, map_file_over
from streamrover.ckpt.api import SharedMemoryTooSmallError

SHM_DIR = "/dev/shm"
MAGIC = b"SRCKPT01"
DATA_START = 4096
ALIGN = 64
_GEN = struct.Struct("<Q")
_HDR = struct.Struct("<QQI")  # header_offset, header_len, header_crc
_PAUSE_AT = 40
_SPLIT_AT = 48
TAIL = "-tail"  # the second file of a split buffer: NAME-tail
SPLIT_FROM = 64 << 20  # a buffer created sparse (a first save) at least this large is split in two files
MAX_PAUSE = 10.0  # a reader never waits longer than this in one pause, whatever a buffer says
PAUSE_POLL = 0.002
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def shm_path(name: str) -> str:
    """The ``/dev/shm`` path of shared-memory object ``name``."""
    return os.path.join(SHM_DIR, name)


def tail_name(name: str) -> str:
    """The name of the second file of split buffer ``name``."""
    return name + TAIL


def tail_path(name: str) -> str:
    """The ``/dev/shm`` path of the second file of split buffer ``name``."""
    return shm_path(tail_name(name))


def unlink_buffer(name: str) -> bool:
    """Remove buffer ``name`` (and its tail file, if split) from ``/dev/shm``; whether it was there."""
    found = False
    for path in (shm_path(name), tail_path(name)):
        try:
            os.unlink(path)
            found = True
        except FileNotFoundError:
            pass
    return found


def check_shm_space(extra_bytes: int, what: str) -> None:
    """Raise :class:`SharedMemoryTooSmallError` if ``/dev/shm`` cannot take ``extra_bytes`` more."""
    if extra_bytes <= 0:
        return
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        raise SharedMemoryTooSmallError(
            f"{SHM_DIR} is not usable ({exc}); flash checkpoints need POSIX shared memory"
        ) from exc
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    if extra_bytes > free:
        raise SharedMemoryTooSmallError(_too_small_message(extra_bytes, free, total, what))


def _fallocate(fd: int, name: str, size: int, current: int) -> None:
    _fallocate_range(fd, name, 0, size, size - current)


def _fallocate_range(fd: int, name: str, offset: int, length: int, missing: int | None = None) -> None:
    """Allocate bytes ``offset`` to ``offset + length`` of tmpfs file ``fd`` now (``missing`` of them new), or raise
    :class:`SharedMemoryTooSmallError` when ``/dev/shm`` cannot hold them."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)  # tmpfs: allocates the pages now, or fails with ENOSPC
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            st = os.statvfs(SHM_DIR)
            raise SharedMemoryTooSmallError(
                _too_small_message(
                    length if missing is None else missing, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, name
                )
            ) from exc
        raise


def _too_small_message(needed: int, free: int, total: int, what: str) -> str:
    mib = 1 << 20
    return (
        f"{SHM_DIR} is too small for {what}: needs {needed / mib:.1f} MiB more, "
        f"{free / mib:.1f} MiB free of {total / mib:.1f} MiB. Enlarge it (docker run --shm-size=..., "
        "Kubernetes: mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm), "
        "or use fewer snapshot buffers (Checkpointer(num_buffers=...)), or save a smaller state per rank."
    )


class SharedBuffer:
    """A named, memory-mapped ``/dev/shm`` file holding at most one snapshot."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, writable: bool, split: int = 0) -> None:
        self.name = name
        self.mm = mm
        self.size = size
        self.writable = writable
        self.split = split  # 0, or where the tail file's pages start

    # -- lifecycle -----------------------------------------------------------
    @classmethod
    def create(cls, name: str, size: int, populate: bool = True, allocate: bool = True) -> SharedBuffer:
        """Create (or grow) ``name`` to ``size`` bytes, allocate every page and map it (pre-faulted if ``populate``).

        Allocating up front means a full ``/dev/shm`` is a clear error now, never a SIGBUS mid-copy.
        Pre-faulting maps every page into this process (single-threaded, ~0.3 s/GiB): worth it off the
        critical path. A buffer about to be written at once is created sparse (``allocate=False``) and, from
        :data:`SPLIT_FROM` bytes, split in two files: its first copy ``pwrite``s each file on a thread of its own
        (the kernel allocates each page as it copies into it; no page fault, no zeroing, a full ``/dev/shm`` is
        ``ENOSPC``), and :meth:`allocate` then allocates the rest (header, gaps) before anything else is written.
        """
        fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT, 0o600)
        tail = -1
        try:
            current = os.fstat(fd).st_size
            split = _read_split(fd) if current >= DATA_START else 0
            new_split = current == 0 and not allocate and size >= SPLIT_FROM
            if new_split:
                split = align(size // 2, 1 << 21)
            if split:
                tail = os.open(tail_path(name), os.O_RDWR | os.O_CREAT, 0o600)
            if size > current:
                check_shm_space(size - current, f"a {size / (1 << 20):.1f} MiB snapshot buffer {name!r}")
                if split:  # the tail first: a reader that sees the first file's new size finds the tail as large
                    tail_now = os.fstat(tail).st_size
                    if allocate:
                        _fallocate(tail, name, size - split, tail_now)
                        _fallocate(fd, name, split, min(current, split))
                    os.ftruncate(tail, max(size - split, tail_now))
                    os.ftruncate(fd, size)  # a hole beyond ``split``: the tail's pages are mapped there
                elif allocate:
                    _fallocate(fd, name, size, current)
                else:
                    os.ftruncate(fd, size)
            size = max(size, current)
            if split and os.fstat(tail).st_size < size - split:  # a tail removed behind our back: holes, no SIGBUS
                os.ftruncate(tail, size - split)
            # the first file of a split buffer is never populated beyond ``split`` (that would allocate its hole)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate and not split else 0)
            mm = mmap.mmap(fd, size, flags=flags)
            if split:
                _map_tail(mm, split, size - split, mmap.PROT_READ | mmap.PROT_WRITE, tail)
        finally:
            os.close(fd)
            if tail >= 0:
                os.close(tail)
        if new_split:
            _GEN.pack_into(mm, _SPLIT_AT, split)  # before the magic: no reader maps a half-made buffer
        if mm[:8] != MAGIC:
            mm[:8] = MAGIC
            _GEN.pack_into(mm, 8, 0)
        buf = cls(name, mm, size, writable=True, split=split)
        if populate and split:
            buf.populate()
        return buf

    def allocate(self, written: Sequence[tuple[int, int]] = ()) -> None:
        """Allocate every page of the buffer not allocated yet (after a sparse :meth:`create` and its first copy).

        ``written``: ``(offset, bytes)`` ranges the first copy wrote, whose pages the kernel allocated then; only
        the pages outside them are allocated here (``fallocate`` over 1 GiB already written walks its 262,144
        pages: 0.04-0.1 s here, a fifth of a first save).
        """
        page = mmap.PAGESIZE
        gaps: list[tuple[int, int]] = []
        at = 0
        for off, n in [*sorted((o, n) for o, n in written if n > 0), (self.size, 0)]:
            start, end = -(-at // page) * page, off // page * page  # the whole pages between two writes
            if end > start:
                gaps.append((start, end))
            at = max(at, off + n)
        split = self.split or self.size
        for (name, size), base in zip(self.files(), (0, split)):
            fd = os.open(shm_path(name), os.O_RDWR)
            try:
                for start, end in gaps:
                    start, end = max(start, base) - base, min(end, base + size) - base
                    if end > start:
                        _fallocate_range(fd, self.name, start, end - start)
            finally:
                os.close(fd)

    def files(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of the file(s) holding the buffer: the first up to ``split``, then the tail."""
        if not self.split:
            return [(self.name, self.size)]
        return [(self.name, self.split), (tail_name(self.name), self.size - self.split)]

    def populate(self) -> None:
        """Map every page into this process (``MADV_POPULATE_WRITE``), so the next copy takes no page faults;
        a no-op where the kernel lacks it (before Linux 5.14): the copy faults the pages in instead.

        The call releases the GIL (``mmap.madvise`` holds it for the whole call, 0.3-0.5 s per GiB here):
        run in a background thread, it neither delays the thread that started it nor stalls training.
        """
        try:
            view = (ctypes.c_char * self.size).from_buffer(self.mm)
        except (TypeError, ValueError, BufferError):  # closed, or mapped read-only: nothing to populate for writes
            return
        try:
            madvise(ctypes.addressof(view), self.size, MADV_POPULATE_WRITE)
        except OSError:  # not this kernel (EINVAL), or no memory left to map: the copy faults the pages in instead
            pass
        finally:
            del view  # the export must go before the mapping can be closed

    @classmethod
    def open(cls, name: str, writable: bool = False) -> SharedBuffer | None:
        """Map an existing buffer, or return None if it does not exist or is not a snapshot buffer."""
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < DATA_START:
                return None
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        split = _GEN.unpack_from(mm, _SPLIT_AT)[0] if mm[:8] == MAGIC else -1
        if split and not _open_tail(mm, name, split, size, prot):
            mm.close()
            return None
        return cls(name, mm, size, writable, split)

    def close(self) -> None:
        """Unmap; tolerates live zero-copy views (the mapping then lives until they are gone)."""
        try:
            self.mm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        """Remove the buffer from ``/dev/shm`` (mappings stay valid until closed); gone already is fine."""
        unlink_buffer(self.name)

    # -- seqlock ---------------------------------------------------------------
    def generation(self) -> int:
        """The seqlock generation: odd while a write is in progress, even when the content is whole."""
        value: int = _GEN.unpack_from(self.mm, 8)[0]
        return value

    def begin_write(self) -> int:
        """Mark the buffer as being written (odd generation); return that odd generation."""
        gen = self.generation()
        gen = gen + 1 if gen % 2 == 0 else gen + 2  # a crashed writer may have left it odd
        _GEN.pack_into(self.mm, 8, gen)
        return gen

    def end_write(self, odd_gen: int, header: dict[str, Any]) -> int:
        """Write ``header`` after the data and publish the snapshot; return its (even) generation."""
        blob = json.dumps(header, separators=(",", ":")).encode()
        offset = int(header["header_offset"])
        if offset + len(blob) > self.size:
            raise ValueError(
                f"snapshot header does not fit in buffer {self.name!r} ({offset + len(blob)} > {self.size})"
            )
        self.mm[offset : offset + len(blob)] = blob
        _HDR.pack_into(self.mm, 16, offset, len(blob), zlib.crc32(blob))
        _GEN.pack_into(self.mm, 8, odd_gen + 1)
        return odd_gen + 1

    # -- pausing a reader ------------------------------------------------------
    def set_pause(self, seconds: float) -> None:
        """Ask readers of this buffer (a persist) to pause for up to ``seconds``; 0 lets them go on now."""
        until = time.monotonic_ns() + int(seconds * 1e9) if seconds > 0 else 0
        _GEN.pack_into(self.mm, _PAUSE_AT, until)

    def wait_while_paused(self) -> float:
        """Block while a writer asks readers of this buffer to pause (:meth:`set_pause`); return seconds waited."""
        start = time.monotonic_ns()
        slept = False
        while True:
            until: int = _GEN.unpack_from(self.mm, _PAUSE_AT)[0]
            now = time.monotonic_ns()
            if until <= now or now - start >= MAX_PAUSE * 1e9:
                return (now - start) / 1e9 if slept else 0.0
            slept = True
            # Another process's flag, no shared futex to wait on: poll it; 2 ms late at most in resuming.
            time.sleep(min(PAUSE_POLL, (until - now) / 1e9))

    def invalidate(self) -> None:
        """Make the snapshot in this buffer unreadable (odd generation) until the next write."""
        self.begin_write()

    def read_header(self) -> tuple[int, dict[str, Any]] | None:
        """``(generation, header)`` of the complete snapshot in this buffer, or None if there is none."""
        gen = self.generation()
        if gen == 0 or gen % 2 == 1:
            return None
        offset, length, crc = _HDR.unpack_from(self.mm, 16)
        if offset < DATA_START or offset + length > self.size:
            return None
        blob = bytes(self.mm[offset : offset + length])
        if zlib.crc32(blob) != crc or self.generation() != gen:
            return None
        try:
            header: dict[str, Any] = json.loads(blob)
        except ValueError:
            return None
        return gen, header

    def still_valid(self, gen: int) -> bool:
        """True while the snapshot read at generation ``gen`` has not been overwritten."""
        return self.generation() == gen


def _read_split(fd: int) -> int:
    """The ``split`` field of the buffer file ``fd`` (0: one file)."""
    value: int = _GEN.unpack(os.pread(fd, _GEN.size, _SPLIT_AT).ljust(_GEN.size, b"\0"))[0]
    return value


def _map_tail(mm: mmap.mmap, split: int, length: int, prot: int, fd: int) -> None:
    """Map the tail file ``fd`` over bytes ``split`` to ``split + length`` of ``mm`` (unmapped with ``mm``)."""
    view = np.frombuffer(mm, dtype=np.uint8)  # the mapping's address, even for a read-only mapping
    address = int(view.ctypes.data)
    del view
    map_file_over(address + split, length, prot, fd)


def _open_tail(mm: mmap.mmap, name: str, split: int, size: int, prot: int) -> bool:
    """Map the tail of split buffer ``name`` into ``mm``; False if the buffer is not whole (no snapshot buffer)."""
    if split < 0 or not DATA_START <= split < size:
        return False
    try:
        fd = os.open(tail_path(name), os.O_RDWR if prot & mmap.PROT_WRITE else os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_size < size - split:
            return False
        _map_tail(mm, split, size - split, prot, fd)
    finally:
        os.close(fd)
    return True
