"""The memory engine: one rank's ring of shared-memory snapshot buffers.

Saves go to a buffer that the saver is not reading (``busy``), preferring the one
with the oldest snapshot, so a save never waits for a persist and the newest
complete snapshot is only overwritten when every other buffer is being persisted.
Buffers are allocated on first use (or by :meth:`MemoryEngine.prepare`), pre-faulted,
and reused; they grow when the state grows.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrover.ckpt.api import FORMAT_VERSION, SnapshotCopyError, SnapshotRef
from streamrover.ckpt.copier import CopyError, CopyJob, file_writer
from streamrover.ckpt.flatten import TensorEntry, copy_into, flatten, make_tensor, unflatten
from streamrover.ckpt.shm import (
    ALIGN,
    DATA_START,
    SHM_DIR,
    TAIL,
    SharedBuffer,
    align,
    check_shm_space,
    shm_path,
    unlink_buffer,
)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
HEADER_RESERVE = 1 << 20  # room for the header JSON (tensor table, cursor) beyond the tensor bytes
HELPER_FROM_CHUNKS = 4  # a blocking copy of more chunks than this gets a helper thread
# How long a copy asks persists of this rank's other buffers to pause at most: its size at PAUSE_RATE bytes/s,
# and at least MIN_PAUSE (it clears the pause when done, so this bounds only a copy that died or stalled).
PAUSE_RATE = 1e9
MIN_PAUSE = 0.25


def buffer_name(namespace: str, rank: int, index: int) -> str:
    """The shared-memory name of snapshot buffer ``index`` of ``rank`` in ``namespace``."""
    return f"srckpt-{_SAFE.sub('_', namespace)}-r{rank}-b{index}"


def purge_shared_memory(namespace: str, ranks: Iterable[int] | None = None) -> list[str]:
    """Remove the snapshot buffers of ``namespace`` from this node's ``/dev/shm``; return the names removed.

    ``namespace`` is ``namespace_for(url, job)``, the one the trainers' :class:`Checkpointer` used;
    ``ranks`` limits the purge to those ranks' buffers (default: every rank of the namespace).
    Buffers of other namespaces are not touched. Removing a buffer that is
    already gone is not an error, so agents racing to clean up may both call it.

    Use it when a job ends for good, or when an agent gives up on trainers that were SIGKILLed and
    will not be restarted on this node (a restarted trainer would load its snapshot from these
    buffers). Call it only once nothing writes them any more: after the trainers are dead and the
    node's saver is idle (:meth:`CheckpointSaver.wait_idle`), since a saver persisting a dead
    trainer's snapshot opens the buffers by name. A process that still maps a buffer keeps its
    memory until it unmaps; the name is gone at once.
    """
    if not namespace or namespace != namespace.strip():
        raise ValueError(f"namespace must be the non-empty name from namespace_for(), got {namespace!r}")
    prefix = f"srckpt-{_SAFE.sub('_', namespace)}-r"
    wanted = None if ranks is None else {int(r) for r in ranks}
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:  # no POSIX shared memory on this system: nothing of ours can be there
        return []
    removed = []
    for name in names:
        m = re.fullmatch(rf"(\d+)-b\d+(?:{TAIL})?", name[len(prefix) :]) if name.startswith(prefix) else None
        if m is None or (wanted is not None and int(m.group(1)) not in wanted):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


@dataclass
class Snapshot:
    """A complete snapshot found in a buffer: where, which generation, and its header."""

    index: int
    name: str
    generation: int
    header: dict[str, Any]

    @property
    def step(self) -> int:
        """The training step of the snapshot."""
        return int(self.header["step"])

    @property
    def seq(self) -> int:
        """The snapshot's sequence number (the newest snapshot has the highest)."""
        return int(self.header["seq"])

    def ref(self) -> SnapshotRef | None:
        """Where another process of this node can map this snapshot (None: written before snapshots had ids)."""
        uid = self.header.get("uid")
        return SnapshotRef(self.name, self.generation, str(uid)) if uid else None


def plan_layout(entries: list[TensorEntry]) -> tuple[list[int], int]:
    """Offsets of each tensor in a buffer and the end of the data region."""
    offsets = []
    pos = DATA_START
    for entry in entries:
        offsets.append(pos)
        pos = align(pos + entry.nbytes, ALIGN)
    return offsets, pos


class MemoryEngine:
    """The snapshot buffers of one rank, as the trainer process sees them."""

    def __init__(self, namespace: str, rank: int, num_buffers: int = 2) -> None:
        if num_buffers < 2:
            raise ValueError(f"num_buffers must be >= 2 (double buffering), got {num_buffers}")
        self.namespace = namespace
        self.rank = rank
        self.num_buffers = num_buffers
        self.buffers: list[SharedBuffer | None] = [None] * num_buffers
        self._seq = 0
        self._prefault: threading.Thread | None = None
        self.attach()

    def names(self) -> list[str]:
        """The shared-memory names of this rank's buffers."""
        return [buffer_name(self.namespace, self.rank, i) for i in range(self.num_buffers)]

    def attach(self) -> None:
        """Map buffers left by an earlier trainer of this rank (process restart on a live node)."""
        self._join_prefault()
        for i, name in enumerate(self.names()):
            if self.buffers[i] is None:
                self.buffers[i] = SharedBuffer.open(name, writable=True)
        newest = self.newest()
        if newest is not None:
            self._seq = max(self._seq, newest.seq)

    def capacity_needed(self, entries: list[TensorEntry]) -> int:
        """Bytes a buffer needs to hold tensors ``entries`` (data and header)."""
        _, data_end = plan_layout(entries)
        return data_end + HEADER_RESERVE

    def prepare(self, state: Any) -> None:
        """Allocate and pre-fault every buffer for ``state`` now, off the critical path of the first save."""
        _, entries = flatten(state)
        self._ensure_all(self.capacity_needed(entries))

    def _ensure_all(self, size: int) -> None:
        self._join_prefault()
        missing = sum(size - (b.size if b else 0) for b in self.buffers if b is None or b.size < size)
        check_shm_space(
            missing, f"{self.num_buffers} snapshot buffers of {size / (1 << 20):.1f} MiB (rank {self.rank})"
        )
        for i in range(self.num_buffers):
            self._ensure(i, size)

    def _ensure(self, index: int, size: int, populate: bool = True, allocate: bool = True) -> SharedBuffer:
        buf = self.buffers[index]
        if buf is not None and buf.size >= size:
            return buf
        grown = size + size // 16 if buf is not None else size  # grow with slack, the state grew once already
        if buf is not None:
            buf.close()
        new = SharedBuffer.create(self.names()[index], align(grown, 1 << 21), populate, allocate)
        self.buffers[index] = new
        return new

    # -- reading -------------------------------------------------------------
    def snapshots(self) -> list[Snapshot]:
        """The complete snapshots held by this rank's mapped buffers (a buffer being written holds none)."""
        self._join_prefault()  # a buffer it grows is closed, then replaced: never read one in between
        out = []
        for i, buf in enumerate(self.buffers):
            if buf is None:
                continue
            found = buf.read_header()
            if found is not None:
                out.append(Snapshot(i, buf.name, found[0], found[1]))
        return out

    def newest(self) -> Snapshot | None:
        """The newest complete snapshot, or None."""
        snaps = self.snapshots()
        return max(snaps, key=lambda s: s.seq) if snaps else None

    def load(self, snap: Snapshot, zero_copy: bool) -> Any:
        """The state held by ``snap``: views of shared memory if ``zero_copy``, private copies otherwise."""
        buf = self.buffers[snap.index]
        assert buf is not None
        return read_state(buf.mm, snap.header, zero_copy)

    # -- writing -------------------------------------------------------------
    def choose(self, busy: Iterable[int]) -> int:
        """The buffer the next save writes: not busy, holding the oldest (or no) snapshot."""
        busy = set(busy)
        free = [i for i in range(self.num_buffers) if i not in busy]
        if not free:
            raise RuntimeError("every snapshot buffer is busy; the saver holds more buffers than it may")
        seqs = {s.index: s.seq for s in self.snapshots()}
        return min(free, key=lambda i: (seqs.get(i, -1), i))

    def write(
        self,
        index: int,
        step: int,
        state: Any,
        meta: dict[str, Any],
        *,
        defer: Callable[[Any], bool] | None = None,
        on_published: Callable[[Snapshot], None] | None = None,
    ) -> SnapshotWrite:
        """Copy ``state`` into buffer ``index``; the snapshot is published (header written) once the copy is done.

        Without ``defer`` (or when it defers nothing) the whole copy is done when this returns, and
        so is the publication. Torch tensors for which ``defer(tensor)`` is true are copied by a
        background thread after this returns: the caller must not mutate them until
        :meth:`SnapshotWrite.wait` has returned. Everything else is copied before this returns.
        ``on_published`` runs in whichever thread completes the copy, right after the header is written.
        """
        skeleton, entries = flatten(state)
        offsets, data_end = plan_layout(entries)
        header: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "seq": self._seq + 1,
            "uid": os.urandom(8).hex(),  # names this snapshot for processes that map it (SnapshotRef)
            "step": step,
            "rank": self.rank,
            "skeleton": skeleton,
            "tensors": [e.table_row(o) for e, o in zip(entries, offsets)],
            "data_end": data_end,
            "header_offset": data_end,
            **meta,
        }
        size_needed = data_end + HEADER_RESERVE
        self._join_prefault()
        others: list[int] = []
        if all(b is None or b.size < size_needed for b in self.buffers):
            # First save (or the state outgrew every buffer): check the whole ring fits and allocate the
            # buffer written now; the others are allocated in the background once this copy is done, so
            # they neither delay this save nor compete with its copy for cores and memory bandwidth.
            missing = sum(size_needed - (b.size if b else 0) for b in self.buffers)
            check_shm_space(missing, f"{self.num_buffers} snapshot buffers of {size_needed / (1 << 20):.1f} MiB")
            others = [i for i in range(self.num_buffers) if i != index]
        # A buffer new at this size is created sparse and written with pwrite: the kernel allocates each page as it
        # copies into it (no page fault, no zeroing; a full /dev/shm is ENOSPC, not a SIGBUS). Writes to one tmpfs
        # file hold its inode lock, so a large one is two files (SharedBuffer.create), one pwriting thread each:
        # 1 GiB in 0.22 s, against 0.40 s for one file. The rest (header, gaps) is allocated once the copy is done.
        sources = [_raw_source(entry) if entry.nbytes else None for entry in entries]
        fresh = bool(others) and all(src is not None for src, e in zip(sources, entries) if e.nbytes)
        buf = self._ensure(index, size_needed, populate=not others, allocate=not fresh)
        paused = [b for i, b in enumerate(self.buffers) if i != index and b is not None]
        for other in paused:  # a persist reading one of them waits until this copy is done (SharedBuffer.set_pause)
            other.set_pause(max(MIN_PAUSE, data_end / PAUSE_RATE))
        odd = buf.begin_write()
        self._seq += 1
        dst = np.frombuffer(buf.mm, dtype=np.uint8)  # released (with the sources) when the copy is done
        base = int(dst.ctypes.data)
        now: list[tuple[int, int, int]] = []
        later: list[tuple[int, int, int]] = []
        keep: list[Any] = [dst]
        for entry, offset, src in zip(entries, offsets, sources):
            if entry.nbytes == 0:
                continue
            if src is None:  # not plain contiguous host memory: torch copies it, now
                copy_into(entry, buf.mm, offset)
                continue
            keep.append(src[1])
            deferred = defer is not None and entry.kind == "torch" and defer(entry.value)
            (later if deferred else now).append((base + offset, src[0], entry.nbytes))
        pending = SnapshotWrite(self, index, buf, odd, header, size_needed, others, on_published, fresh, paused)
        fds: list[int] = []
        try:
            if fresh:
                fds = [os.open(shm_path(name), os.O_RDWR) for name, _ in buf.files()]
                _pwrite_files(now, base, buf, fds, keep)
                # the header, the gaps and the deferred tensors: never a SIGBUS writing them
                buf.allocate([(dst - base, n) for dst, _, n in now])
            else:
                sync = CopyJob(now, keep)
                # A helper pays for its start (~1 ms on a loaded box) only from a few chunks on; below, one copies.
                sync.start(1 if sync.chunks > HELPER_FROM_CHUNKS else 0, name="ckpt-copy-now")
                sync.wait()
        except (CopyError, OSError) as exc:  # the generation stays odd: the buffer holds no snapshot
            pending.resume_readers()
            raise SnapshotCopyError(f"the snapshot of step {step} was not taken: its copy failed ({exc})") from exc
        finally:
            for fd in fds:
                os.close(fd)
        pending.job = CopyJob(later, keep, on_complete=pending._publish)
        del keep, dst
        pending.job.start(1, name="ckpt-copy-bg")
        return pending

    def _start_prefault(self, others: list[int], size: int, populate: int | None = None) -> None:
        """Allocate and pre-fault buffers ``others`` (and map in the pages of buffer ``populate``) in the background."""

        def run() -> None:
            if populate is not None and (buf := self.buffers[populate]) is not None:
                buf.populate()
            for i in others:
                self._ensure(i, size)

        self._prefault = threading.Thread(target=run, name="ckpt-prefault", daemon=True)
        self._prefault.start()

    def _join_prefault(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
            self._prefault = None

    def unlink(self) -> None:
        """Close the buffers and remove them from ``/dev/shm`` (the snapshots are gone)."""
        self._join_prefault()
        for buf in self.buffers:
            if buf is not None:
                buf.close()
        for name in self.names():
            unlink_buffer(name)
        self.buffers = [None] * self.num_buffers


def _pwrite_files(
    ranges: list[tuple[int, int, int]], base: int, buf: SharedBuffer, fds: list[int], keep: list[Any]
) -> None:
    """Write ``(address, source, n)`` ranges (addresses in ``buf``'s mapping at ``base``) with ``pwrite`` into the
    buffer's file(s) ``fds``: a split buffer's two files each on a thread of their own (two inode locks)."""
    split = buf.split or buf.size
    parts: list[list[tuple[int, int, int]]] = [[], []]
    for dst, src, n in ranges:
        off = dst - base
        head = max(0, min(n, split - off))
        if head:
            parts[0].append((off, src, head))
        if n > head:
            parts[1].append((off + head - split, src + head, n - head))
    jobs = [CopyJob(part, keep, copy=file_writer(fd)) for part, fd in zip(parts, fds) if part]
    if len(jobs) == 2:
        jobs[1].start(1, name="ckpt-copy-tail")
    failed: CopyError | None = None
    for job in jobs:  # every job to its end, failed or not: the caller closes the files they write
        try:
            job.wait()  # works through its chunks (the first file's, then helps with the tail's), then waits
        except CopyError as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


def _raw_source(entry: TensorEntry) -> tuple[int, Any] | None:
    """(address, owner) of ``entry``'s bytes when they can be copied raw: contiguous host memory, no lazy bits."""
    value = entry.value
    if entry.kind == "numpy":
        arr = np.ascontiguousarray(value)  # a strided array is copied here: the copy is then the snapshot
        return int(arr.ctypes.data), arr
    if value.device.type != "cpu" or not value.is_contiguous() or value.is_conj() or value.is_neg():
        return None
    return int(value.data_ptr()), value


class SnapshotWrite:
    """A snapshot whose copy may still be running; :meth:`wait` returns it once published."""

    def __init__(
        self,
        engine: MemoryEngine,
        index: int,
        buf: SharedBuffer,
        odd: int,
        header: dict[str, Any],
        size_needed: int,
        others: list[int],
        on_published: Callable[[Snapshot], None] | None,
        fresh: bool = False,
        paused: list[SharedBuffer] | None = None,
    ) -> None:
        self.engine = engine
        self._fresh = fresh
        self._paused = paused or []
        self.index = index
        self.step = int(header["step"])
        self._buf = buf
        self._odd = odd
        self._header = header
        self._size_needed = size_needed
        self._others = others
        self._on_published = on_published
        self.job: CopyJob | None = None
        self.snapshot: Snapshot | None = None

    def resume_readers(self) -> None:
        """Let the persists this copy paused go on."""
        for buf in self._paused:
            buf.set_pause(0)

    def _publish(self) -> None:
        self.resume_readers()
        gen = self._buf.end_write(self._odd, self._header)
        self.snapshot = Snapshot(self.index, self._buf.name, gen, self._header)
        if self._others or self._fresh:
            self.engine._start_prefault(self._others, self._size_needed, self.index if self._fresh else None)
        if self._on_published is not None:
            self._on_published(self.snapshot)

    @property
    def deferred(self) -> bool:
        """True if part of the copy was left to the background thread."""
        return self.job is not None and self.job.chunks > 0

    def wait(self) -> Snapshot:
        """Help finish the copy, wait for the publication; raise :class:`SnapshotCopyError` if the copy failed."""
        assert self.job is not None
        try:
            self.job.wait()
        except CopyError as exc:
            self.resume_readers()
            raise SnapshotCopyError(
                f"the snapshot of step {self.step} was not taken: its background copy failed ({exc}); "
                "the previous snapshot is still the newest"
            ) from exc
        assert self.snapshot is not None
        return self.snapshot


def read_state(buffer: Any, header: dict[str, Any], zero_copy: bool) -> Any:
    """Rebuild the state of a snapshot header from ``buffer`` (mmap or bytes-like)."""
    rows = header["tensors"]

    def make(i: int) -> Any:
        row = rows[i]
        t = make_tensor(row["kind"], row["dtype"], row["shape"], buffer, int(row["offset"]))
        return t if zero_copy else t.copy() if row["kind"] == "numpy" else t.clone()

    return unflatten(header["skeleton"], make)
