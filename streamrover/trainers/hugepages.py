"""A warm standby folds its anonymous memory into 2 MB pages, so the worker it becomes dies faster.

When a worker dies, its group restarts only after the kernel has freed its memory (its peers learn of the
death when its sockets close, which comes after) and then the survivors' the agent stops: ~45 ms per GB each
here with 4 KB pages, mostly the walk over page-table entries. A torch worker holds ~0.4 GB of anonymous
memory after its imports alone (the interpreter's heap, libraries' zero-initialised data: cuBLASLt's is
90 MB). ``dlrover-run`` makes malloc advise huge pages for what the worker allocates later
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, :func:`streamrover.trainers.torch.run.malloc_tunables`); what
the imports left in 4 KB pages is collapsed here, once, in the standby before it reports warm (off any
restart's path; ~0.05-0.5 s of its CPU). A 1 GB torch process's teardown: ~40 ms -> ~20 ms.

``MADV_COLLAPSE`` (Linux >= 6.1) is advice: where the kernel refuses it (older kernels, no huge page
free) nothing changes. ``GLIBC_TUNABLES`` with ``glibc.malloc.hugetlb=0`` (the opt-out of the malloc advice)
turns this off too.
"""

from __future__ import annotations

import os

from streamrover._libc import madvise

MADV_COLLAPSE = 25
HUGE = 2 << 20


def _private_anonymous(maps: str) -> list[tuple[int, int]]:
    """The writable private anonymous mappings (the heap and unnamed ones) in ``/proc/PID/maps`` text."""
    out = []
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[1] != "rw-p" or (len(parts) > 5 and parts[5] != "[heap]"):
            continue
        low, high = (int(x, 16) for x in parts[0].split("-"))
        out.append((low, high))
    return out


def collapse() -> int:
    """Collapse this process's private anonymous memory into huge pages; returns the bytes advised that the kernel
    took (0 where it cannot: not Linux >= 6.1, or no huge page free; or opted out, see the module docstring)."""
    if "glibc.malloc.hugetlb=0" in os.environ.get("GLIBC_TUNABLES", ""):
        return 0
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            maps = f.read()
    except OSError:
        return 0
    done = 0
    for low, high in _private_anonymous(maps):
        start, end = -(-low // HUGE) * HUGE, high // HUGE * HUGE  # whole 2 MB pages inside the mapping
        if end <= start:
            continue
        try:
            madvise(start, end - start, MADV_COLLAPSE)
        except OSError:  # refused: advice only
            continue
        done += end - start
    return done
