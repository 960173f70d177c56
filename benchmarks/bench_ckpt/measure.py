"""The flash checkpoint bench's ground rules: sizes, signals and cleanup of children, timing, the states."""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
#: DLRover's venv (``make dlrover-venv``: scripts/build-dlrover-venv.sh) unless STREAMROVER_DLROVER_PYTHON names one
DLROVER_PY = os.environ.get("STREAMROVER_DLROVER_PYTHON") or os.path.join(
    os.environ.get("STREAMROVER_CACHE") or os.path.expanduser("~/.cache/streamrover"), "dlrover-venv", "bin", "python")
# Peak resident memory of one size, in state sizes: the state, our two shared-memory buffers and the memcpy
# peer's destination while saving (page cache is reclaimable); the restore children need less.
PEAK_FACTOR = 4.0
MEMORY_MARGIN = GIB  # interpreters, torch, the saver, the DLRover peer's own process
DISK_FACTOR = 4.0  # torch.save file + a DCP checkpoint + our newest and next persisted checkpoint
CHILD_GRACE = 15.0


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived; unwinds through every ``finally`` so cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup must not be interrupted in turn
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Interrupted(signum)


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, _raise_interrupted)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def timed(fn: Callable[[], Any], warmups: int, repeats: int, before: Callable[[], Any] | None = None) -> list[float]:
    """``fn`` run ``warmups`` times untimed, then ``repeats`` times timed; ``before`` runs untimed each time."""
    times = []
    for i in range(warmups + repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t
        if i >= warmups:
            times.append(elapsed)
    return times


def drop_cache(path: Path | str) -> None:
    """Write back and drop the page cache of a file, or of every file under a directory."""
    paths = [Path(path)] if Path(path).is_file() else [p for p in Path(path).rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_state(nbytes: int, tensors: int) -> dict[str, Any]:
    import torch

    n = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.randn(n) for i in range(tensors)}


def empty_model(nbytes: int, tensors: int) -> Any:
    """The restarted trainer's model, already built (pages touched), that a restore copies into: a module whose
    parameters are named like :func:`make_state`'s tensors (``layer{i}.weight``)."""
    import torch

    n = nbytes // 4 // tensors
    model = torch.nn.Module()
    for i in range(tensors):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(n))
        model.add_module(f"layer{i}", layer)
    return model


def into_model(state: dict[str, Any], model: Any) -> None:
    """A torch user's restore: ``load_state_dict`` copies into the live parameters."""
    model.load_state_dict(state)


def into_model_ours(state: dict[str, Any], model: Any) -> None:
    """Ours: :func:`~streamrover.ckpt.load_module_state`, what ``TorchCheckpoint.load`` and the HF trainer call."""
    from streamrover.ckpt import load_module_state

    load_module_state(model, state)


def page_reporting() -> str | None:
    """A line on the VM's free page reporting (virtio-balloon), or None where the kernel has none.

    With it, free memory goes back to the host, and the first touch of a page the host took back faults on the host
    too: a first save (every page new) then costs more, and how much more changes from run to run (session 23: a
    first save after 3 GiB was freed and reported took 0.25-0.39 s, against 0.22-0.30 s right after the free).
    """
    params = Path("/sys/module/page_reporting/parameters")
    try:
        order = (params / "page_reporting_order").read_text().strip()
        reported = int((params / "reported_kib").read_text())
    except (OSError, ValueError):
        return None
    try:  # not in every kernel's page reporting
        extra = f", reported after {(params / 'min_free_ms').read_text().strip()} ms free"
    except OSError:
        extra = ""
    return (
        f"VM free page reporting: on (blocks of order {order}{extra}; {reported / (1 << 20):,.0f} GiB reported since "
        "boot): a first touch of memory the host took back faults on the host too (first saves vary with it)"
    )
