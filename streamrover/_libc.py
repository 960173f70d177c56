"""The C library through ctypes: the Linux calls several modules make, ``madvise``, ``prctl`` and ``mmap`` at a
fixed address (which Python's :mod:`mmap` cannot).

:data:`LIBC` is the process's own C library (``CDLL(None, use_errno=True)``); :func:`madvise` and
:func:`set_parent_death_signal` call it with typed arguments and raise :class:`OSError` with the call's
``errno`` on failure (where the C library has no such function, not Linux: ``ENOSYS``). A ctypes call
through a ``CDLL`` releases the GIL, so a long ``madvise`` (populating a GiB of shared memory) runs
alongside the process's Python threads, unlike ``mmap.madvise``, which holds it. Standard library only:
the serving venv's numpy-only modules import :mod:`streamrover.ckpt`, which uses this module.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
MAP_FIXED = 0x10  # Linux, every architecture (Python's mmap module does not export it)

LIBC = ctypes.CDLL(None, use_errno=True)


def _function(name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Callable[..., int] | None:
    """``name`` from :data:`LIBC` as its own function object (typed ``int name(argtypes)``), or None if absent."""
    try:
        fn = LIBC[name]  # a new object, so the argtypes set here are nobody else's
    except AttributeError:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_madvise = _function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_mmap = _function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
                  ctypes.c_void_p)  # fmt: skip
_prctl = _function("prctl", [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong])


def _check(name: str, fn: Callable[..., int] | None, *args: int) -> None:
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name}: not in this C library (not Linux)")
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def madvise(address: int, length: int, advice: int) -> None:
    """``madvise(2)`` on ``length`` bytes at ``address`` (``mmap.MADV_*``), without holding the GIL."""
    _check("madvise", _madvise, address, length, advice)


def map_file_over(address: int, length: int, prot: int, fd: int) -> None:
    """Map ``length`` bytes of file ``fd`` (from offset 0, shared) at ``address``, in place of what was mapped there.

    ``mmap(2)`` with ``MAP_SHARED | MAP_FIXED``: the range must lie inside a mapping this process owns (it is
    unmapped with it); ``prot`` is ``mmap.PROT_*``.
    """
    if _mmap is None:
        raise OSError(errno.ENOSYS, "mmap: not in this C library (not Linux)")
    got = _mmap(address, length, prot, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
    if got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED): {os.strerror(err)}")


def set_parent_death_signal(sig: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, sig)``: this process gets ``sig`` when the thread that forked it ends (0: none)."""
    _check("prctl(PR_SET_PDEATHSIG)", _prctl, PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


__all__ = ["LIBC", "PR_SET_PDEATHSIG", "madvise", "map_file_over", "set_parent_death_signal"]
