"""The C library through ctypes: the two Linux calls several modules make, ``madvise`` and ``prctl``.

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
import os
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1

LIBC = ctypes.CDLL(None, use_errno=True)


def _function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """``name`` from :data:`LIBC` as its own function object (typed ``int name(argtypes)``), or None if absent."""
    try:
        fn = LIBC[name]  # a new object, so the argtypes set here are nobody else's
    except AttributeError:
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_madvise = _function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
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


def set_parent_death_signal(sig: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, sig)``: this process gets ``sig`` when the thread that forked it ends (0: none)."""
    _check("prctl(PR_SET_PDEATHSIG)", _prctl, PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


__all__ = ["LIBC", "PR_SET_PDEATHSIG", "madvise", "set_parent_death_signal"]
