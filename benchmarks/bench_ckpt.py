"""Flash checkpoint benchmark: blocking save time and load time against peers measured in the same run.

Peers: a plain memcpy of the same bytes into pre-touched memory (the physical limit),
``torch.save`` + fsync to local disk, ``torch.distributed.checkpoint.async_save``, and
DLRover's flash checkpoint (``DdpCheckpointer``; run from its own venv, see
``ckpt_dlrover_peer.py``). Load: ours from shared memory in a fresh process (a trainer
restart on a live node) against ``torch.load(weights_only=True)`` of the torch.save file.

    python benchmarks/bench_ckpt.py --sizes 256M,1G,4G
    python benchmarks/bench_ckpt.py --sizes 16M --repeats 2        # quick

Goals (issue 4): save <= 1.5x memcpy; >= 20x faster than torch.save; load >= 5x faster than torch.load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamrover.ckpt import Checkpointer

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DLROVER_PY = os.environ.get("STREAMROVER_DLROVER_PYTHON", "/work/venvs/dlrover/bin/python")
LOAD_SNIPPET = """
import json, sys, time, torch
from streamrover.ckpt import Checkpointer
def into_model(state, model):  # what load_state_dict does: copy into the live parameters
    with torch.no_grad():
        for k, v in state.items():
            model[k].copy_(v)
def load(zero_copy):
    return Checkpointer(sys.argv[1], saver="thread").load(zero_copy=zero_copy, restore=False)
t = time.perf_counter(); loaded = load(True)
zero_copy = time.perf_counter() - t
assert loaded.source.value == "memory", loaded.source
t = time.perf_counter(); load(False)  # a private copy, dropped at once (peak: one state)
copied = time.perf_counter() - t
model = {k: torch.zeros_like(v) for k, v in loaded.state.items()}  # the restarted trainer's model, already built
t = time.perf_counter(); into_model(load(True).state, model)
ours_into_model = time.perf_counter() - t
del loaded
t = time.perf_counter(); sd = torch.load(sys.argv[2], weights_only=True)
tl = time.perf_counter() - t
into_model(sd, model)
tl_into_model = time.perf_counter() - t
print(json.dumps({"memory_load_zero_copy": zero_copy, "memory_load_copy": copied, "torch_load": tl,
                  "ours_into_model": ours_into_model, "torch_load_into_model": tl_into_model}))
"""


# Peak resident memory of one size, in state sizes: the state and two shared-memory buffers (+ slack) while
# saving; then the buffers plus, in the load child, a model and a torch.load result. Page cache comes on top.
PEAK_FACTOR = 4.5


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_state(nbytes: int, tensors: int) -> dict[str, torch.Tensor]:
    n = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.randn(n) for i in range(tensors)}


def bench_memcpy(state: dict[str, torch.Tensor], repeats: int) -> float:
    dst = {k: torch.empty_like(v) for k, v in state.items()}

    def copy() -> None:
        for k, v in state.items():
            dst[k].copy_(v)

    copy()  # touch the destination first, as a reused buffer would be
    return median_time(copy, repeats)


def bench_ours(state: dict[str, torch.Tensor], work: Path, repeats: int, torch_file: Path) -> dict[str, float]:
    root = str(work / "ours")
    ckpt = Checkpointer(root, saver="auto", linger=30.0, persist_on_exit=False)
    try:
        return _bench_ours(ckpt, state, root, repeats, torch_file)
    finally:
        saver = ckpt.saver_pid
        ckpt.close(unlink=True)
        if saver:
            os.kill(saver, signal.SIGTERM)


def _bench_ours(
    ckpt: Checkpointer, state: dict[str, torch.Tensor], root: str, repeats: int, torch_file: Path
) -> dict[str, float]:
    out: dict[str, float] = {}
    t = time.perf_counter()
    ckpt.save(1, state, persist=False)
    out["first_save"] = time.perf_counter() - t
    ckpt.save(2, state, persist=False)  # the second buffer's first use
    blocking = []
    for step in range(3, 3 + repeats):  # memory-only saves: what DLRover's memory saves and memcpy do
        t = time.perf_counter()
        ckpt.save(step, state, persist=False)
        blocking.append(time.perf_counter() - t)
    out["save"] = statistics.median(blocking)
    blocking = []
    for step in range(10, 10 + repeats):  # each save while the previous one is being persisted (2 cores shared)
        t = time.perf_counter()
        ckpt.save(step, state, persist=True)
        blocking.append(time.perf_counter() - t)
    ckpt.wait()
    out["save_during_persist"] = statistics.median(blocking)
    step = 20 + repeats
    t = time.perf_counter()
    ckpt.save(step, state, persist=True)
    ckpt.wait()
    out["persist"] = time.perf_counter() - t
    ckpt.save(step + 1, state, persist=False)  # the newest snapshot is in memory only
    state.clear()  # last user of the state: free it before the load child builds a model and a torch.load copy
    res = subprocess.run(
        [sys.executable, "-c", LOAD_SNIPPET, root, str(torch_file)], capture_output=True, text=True, check=True
    )
    out.update(json.loads(res.stdout))
    return out


def bench_torch_save(state: dict[str, torch.Tensor], path: Path) -> float:
    t = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t


def bench_dcp(state: dict[str, torch.Tensor], work: Path, repeats: int) -> dict[str, float]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{work}/pg-store", rank=0, world_size=1)
    out: dict[str, float] = {}
    times = []
    for i in range(1 + repeats):
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(work / f"dcp-{i}"))
        elapsed = time.perf_counter() - t
        if i == 0:
            out["first_save"] = elapsed
        else:
            times.append(elapsed)
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    out["save"] = statistics.median(times)
    return out


def bench_dlrover(nbytes: int, tensors: int, repeats: int) -> dict[str, Any]:
    if not os.path.exists(DLROVER_PY):
        return {"error": f"no DLRover venv at {DLROVER_PY} (set STREAMROVER_DLROVER_PYTHON)"}
    script = Path(__file__).with_name("ckpt_dlrover_peer.py")
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [DLROVER_PY, str(script), "--bytes", str(nbytes), "--tensors", str(tensors), "--repeats", str(repeats)],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # its forked saver keeps the pipe open: read the one line, then end the group
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for name in os.listdir("/dev/shm"):
        if name.startswith("ckpt_shm_"):
            os.unlink(os.path.join("/dev/shm", name))
    try:
        result: dict[str, Any] = json.loads(line)
    except ValueError:
        errors.seek(0)
        tail = errors.read().strip().splitlines()[-1:] or ["no output"]
        return {"error": f"DLRover peer failed: {tail[0]}"}
    return result


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a and b else "n/a"


def run(size: int, args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        state = make_state(size, args.tensors)
        memcpy = bench_memcpy(state, args.repeats)
        torch_file = work / "torch.pt"
        tsave = bench_torch_save(state, torch_file)
        dcp = bench_dcp(state, work, args.repeats) if not args.skip_dcp else {}
        ours = bench_ours(state, work, args.repeats, torch_file)  # frees the state at its end
        del state
        dl: dict[str, Any] = {"error": "skipped"}
        if not args.skip_dlrover:
            dl = bench_dlrover(size, args.tensors, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = ours["save"]
    rows = [
        (
            "save blocking (steady)",
            f"{s:.4f}",
            "vs memcpy",
            f"{s / memcpy:.2f}x of memcpy {memcpy:.4f}s (goal <= 1.5x)",
        ),
        (
            "save during a persist",
            f"{ours['save_during_persist']:.4f}",
            "vs memcpy",
            f"{ours['save_during_persist'] / memcpy:.2f}x (DLRover skips such saves)",
        ),
        ("save blocking (first)", f"{ours['first_save']:.4f}", "vs memcpy", f"{ours['first_save'] / memcpy:.2f}x"),
        ("torch.save+fsync", f"{tsave:.4f}", "ours faster by", f"{ratio(tsave, s)} (goal >= 20x)"),
    ]
    if dcp:
        rows.append(
            (
                "DCP async_save blocking",
                f"{dcp['save']:.4f}",
                "ours faster by",
                f"{ratio(dcp['save'], s)} (first call {dcp['first_save']:.3f}s: "
                f"{ratio(dcp['first_save'], ours['first_save'])} of our first)",
            )
        )
    if "error" in dl:
        rows.append(("DLRover flash ckpt", "-", "not measured", str(dl["error"])))
    else:
        rows.append(("DLRover memory save", f"{dl['memory_save']:.4f}", "ours faster by", ratio(dl["memory_save"], s)))
        rows.append(
            (
                "DLRover first save",
                f"{dl['first_memory_save']:.4f}",
                "ours faster by",
                ratio(dl["first_memory_save"], ours["first_save"]),
            )
        )
        rows.append(
            (
                "DLRover persist",
                f"{dl['disk_save_persisted']:.4f}",
                "ours faster by",
                f"{ratio(dl['disk_save_persisted'], ours['persist'])} (ours {ours['persist']:.3f}s)",
            )
        )
    tl = ours["torch_load"]
    rows.append(
        (
            "load from memory, restart",
            f"{ours['memory_load_zero_copy']:.4f}",
            "vs torch.load",
            f"{ratio(tl, ours['memory_load_zero_copy'])} faster (torch.load {tl:.3f}s; goal >= 5x)",
        )
    )
    rows.append(
        (
            "load+copy into model",
            f"{ours['ours_into_model']:.4f}",
            "vs torch.load",
            f"{ratio(ours['torch_load_into_model'], ours['ours_into_model'])} faster "
            f"(torch.load+copy {ours['torch_load_into_model']:.3f}s)",
        )
    )
    rows.append(
        (
            "load from memory, copied",
            f"{ours['memory_load_copy']:.4f}",
            "vs torch.load",
            f"{ratio(tl, ours['memory_load_copy'])} faster",
        )
    )
    if "error" not in dl:
        rows.append(
            ("DLRover load (in process)", f"{dl['memory_load_in_process']:.4f}", "note", "same process, no restart")
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256M,1G,4G", help="comma-separated state sizes (K/M/G suffixes)")
    parser.add_argument("--tensors", type=int, default=16, help="tensors per state dict")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="working directory on the local disk (default: system temp)")
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument("--skip-dlrover", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke-sized run: 16M, 2 repeats")
    args, _ = parser.parse_known_args(argv)  # `python -m benchmarks` passes every benchmark the same options
    if args.quick:
        args.sizes, args.repeats = "16M", 2
    print(f"flash checkpoint benchmark: torch {torch.__version__}, {os.cpu_count()} cores", flush=True)
    for text in args.sizes.split(","):
        size = parse_size(text)
        need, have = PEAK_FACTOR * size, available_memory()
        if have is not None and need > have:
            print(
                f"\n== state dict {text.strip()}: skipped, its peak needs ~{need / (1 << 30):.1f} GiB of memory "
                f"and {have / (1 << 30):.1f} GiB is available ==",
                flush=True,
            )
            continue
        rows = run(size, args)
        print(f"\n== state dict {text.strip()} ({size / (1 << 20):.0f} MiB, {args.tensors} tensors) ==")
        width = max(len(r[0]) for r in rows)
        for name, secs, what, note in rows:
            print(f"  {name:<{width}}  {secs:>9} s  {what:<15} {note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
