"""streamrover._libc: its calls take effect, and a failed one raises OSError with the call's errno."""

from __future__ import annotations

import ctypes
import errno
import mmap
import signal
import subprocess
import sys

import pytest

from streamrover._libc import madvise, set_parent_death_signal
from streamrover.testing.procs import python_env

# In a child, so the test process's own parent-death signal is left alone; PR_GET_PDEATHSIG is 2.
_READ_BACK = """
import ctypes, sys
from streamrover._libc import LIBC, set_parent_death_signal
set_parent_death_signal(int(sys.argv[1]))
out = ctypes.c_int(-1)
assert LIBC.prctl(2, ctypes.byref(out)) == 0
print(out.value)
"""


def test_madvise_applies_advice_and_raises_errno_on_failure() -> None:
    size = 4 * mmap.PAGESIZE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = (ctypes.c_char * size).from_buffer(mm)
    try:
        address = ctypes.addressof(view)
        mm[:] = b"x" * size
        madvise(address, size, mmap.MADV_DONTNEED)  # private anonymous pages read back as zeros afterwards
        assert mm[:] == bytes(size)
        with pytest.raises(OSError) as raised:
            madvise(address + 1, size, mmap.MADV_DONTNEED)  # not page-aligned
        assert raised.value.errno == errno.EINVAL
    finally:
        del view
        mm.close()


def test_parent_death_signal_is_set_and_a_bad_signal_raises() -> None:
    for sig in (signal.SIGKILL, signal.SIGTERM):
        out = subprocess.run([sys.executable, "-c", _READ_BACK, str(int(sig))], capture_output=True, text=True,
                             env=python_env(), timeout=60, check=True)  # fmt: skip
        assert int(out.stdout) == sig
    with pytest.raises(OSError) as raised:
        set_parent_death_signal(1000)
    assert raised.value.errno == errno.EINVAL
