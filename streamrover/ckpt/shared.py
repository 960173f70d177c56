"""Reading another process's snapshot on this node: the newest one of a rank, or the one a :class:`SnapshotRef`
names (a restarted DDP group's ranks map the snapshot rank 0 restored instead of receiving it by broadcast).

A reader checks the snapshot's generation and random id before it reads and the generation after (the
buffer's seqlock, :mod:`~streamrover.ckpt.shm`): it gets exactly the bytes of the snapshot named, or False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamrover.ckpt.api import SnapshotRef
from streamrover.ckpt.memory import buffer_name, read_state
from streamrover.ckpt.shm import SharedBuffer


def newest_ref(namespace: str, rank: int, num_buffers: int = 2) -> SnapshotRef | None:
    """The newest complete snapshot of ``rank`` in ``namespace`` on this node, for :func:`load_shared` (None: none)."""
    best: tuple[int, SnapshotRef] | None = None
    for i in range(num_buffers):
        buf = SharedBuffer.open(buffer_name(namespace, rank, i))
        if buf is None:
            continue
        try:
            found = buf.read_header()
        finally:
            buf.close()
        if found is not None and found[1].get("uid") and (best is None or int(found[1]["seq"]) > best[0]):
            best = int(found[1]["seq"]), SnapshotRef(buf.name, found[0], str(found[1]["uid"]))
    return best[1] if best is not None else None


def load_shared(ref: SnapshotRef, consume: Callable[[Any], object]) -> bool:
    """Map the snapshot ``ref`` names and hand its state (views of shared memory) to ``consume``, which must copy
    what it keeps (``load_state_dict`` does). Returns False, without calling ``consume``, when this node holds no
    such snapshot (another node, or the buffer is gone or holds another snapshot now); also False when the
    snapshot was overwritten while ``consume`` ran (what it copied is then torn: load it again from elsewhere).
    """
    buf = SharedBuffer.open(ref.name, writable=True)  # writable: torch warns on read-only views; never written
    if buf is None:
        return False
    try:
        found = buf.read_header()
        if found is None or found[0] != ref.generation or found[1].get("uid") != ref.uid:
            return False
        consume(read_state(buf.mm, found[1], zero_copy=True))
        return buf.still_valid(ref.generation)
    finally:
        buf.close()  # consume's views are gone; a view still alive keeps the mapping until it goes
