"""Builds (once, cached by source hash) the LD_PRELOAD shim in native/loopback_only.c."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tests.brokers._process import MissingDependencyError, cache_root

_SOURCE = Path(__file__).parent / "native" / "loopback_only.c"


def loopback_only_library() -> Path:
    """Path of ``loopback_only.so`` (see its source for what it does), compiling it with ``cc`` if needed."""
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    lib = cache_root() / "native" / f"loopback_only-{digest}.so"
    if lib.exists():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise MissingDependencyError("a C compiler (cc) is needed to build tests/brokers/native/loopback_only.c, "
                                     "which keeps RocketMQ on 127.0.0.1: apt-get install gcc")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SOURCE), "-ldl"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise MissingDependencyError(f"building {_SOURCE} failed:\n{proc.stderr[-3000:]}")
    os.replace(tmp, lib)
    return lib
