"""Recovery after a worker SIGKILL, and goodput under periodic faults: dlrover-run vs torchrun.

Both sides run the same 2-process gloo DDP job (``benchmarks/bench_torch_recovery/worker.py``: an MLP
of ``--layers`` x ``--hidden``, Adam) on this machine:

* **dlrover-run**: streamrover's agent (hosting the checkpoint saver), a StreamSession on a
  parquet dataset through a real job master, flash checkpoints every ``--ckpt-every`` steps;
* **torchrun** ``--max-restarts``: ``torch.save`` from rank 0 every ``--ckpt-every`` steps,
  ``torch.load`` on restart.

Recovery = SIGKILL of local rank 1 → the next optimizer step completed by the restarted
group (median of ``--kills``). Goodput = seconds spent on steps that survive in the final
model / wall seconds, with a SIGKILL every ``--fault-every`` seconds for ``--duration``.
Ratios are dlrover-run over torchrun, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import load as load_average
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess, python_env

WORKER = Path(__file__).resolve().with_name("worker.py")
BIN = Path(sys.executable).parent


class Job:
    def __init__(self, mode: str, root: Path, args: argparse.Namespace) -> None:
        self.mode = mode
        self.root = root / mode
        self.root.mkdir(parents=True)
        self.log = self.root / "steps.txt"
        self.master: MasterProcess | None = None
        self.node_id = f"bench{os.getpid()}-{root.name}-{mode}"  # names this job's shared-memory snapshots
        common = ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "100",
                  "--monitor-interval", "0.1"]  # fmt: skip
        script = [str(WORKER), "--mode", mode, "--hidden", str(args.hidden), "--layers", str(args.layers),
                  "--ckpt-every", str(args.ckpt_every), "--step-log", str(self.log)]  # fmt: skip
        if mode == "streamrover":
            self._dataset()
            assert self.master is not None
            launcher = [str(BIN / "dlrover-run"), *common, "--shard-service", self.master.address,
                        "--token", self.master.token, "--ckpt-dir", str(self.root / "ckpt"),
                        "--node-id", self.node_id]  # fmt: skip
        else:
            launcher = [sys.executable, "-m", "torch.distributed.run", *common]
            script += ["--ckpt-file", str(self.root / "ckpt.pt")]
        out = open(self.root / "launcher.log", "ab")
        env = python_env()
        # Both sides: workers bootstrap a fresh store per attempt. With torch's shared agent store a restarted
        # group can read the dead group's gloo addresses and fail once more before it recovers (torch 2.15).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.proc = subprocess.Popen([*launcher, *script], env=env, stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def _dataset(self) -> None:
        x = np.random.default_rng(0).uniform(-1, 1, 100_000)
        (self.root / "data").mkdir()
        pq.write_table(pa.table({"x": x, "y": 3 * x + 1}), self.root / "data" / "p.parquet", row_group_size=10_000)
        self.master = MasterProcess(self.root / "master", lease_ttl=10.0)
        self.master.start()
        with ShardClient(self.master.address, token=self.master.token, heartbeat=False) as admin:
            admin.register_dataset(
                DatasetSpec("bench", str(self.root / "data"), records_per_shard=5_000, epochs=10_000)
            )

    def steps(self) -> list[tuple[float, int]]:
        return [(t, step) for t, step, _ in self.step_rows()]

    def step_rows(self) -> list[tuple[float, int, int]]:
        """``(time, step, pid of rank 0)`` per optimizer step, in log order."""
        if not self.log.exists():
            return []
        rows = []
        for line in self.log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
        return rows

    def workers(self) -> list[psutil.Process]:
        """The live worker processes (each rank writes its pid next to the step log)."""
        found = []
        for rank in (0, 1):
            try:
                proc = psutil.Process(int(Path(f"{self.log}.pid{rank}").read_text()))
                if proc.status() != psutil.STATUS_ZOMBIE and proc.ppid() == self.proc.pid:
                    found.append(proc)
            except (OSError, ValueError, psutil.Error):  # not written yet, or exited while we looked
                continue
        return found

    def wait(self, predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        give_up = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > give_up or self.proc.poll() is not None:
                raise RuntimeError(f"{self.mode}: no {what} within {timeout} s; see {self.root / 'launcher.log'}")
            time.sleep(0.02)  # polling a log file written by another process

    def standbys_warm(self) -> bool:
        """dlrover-run: its agent's last health line says both standby interpreters are warm (steady state)."""
        if self.mode != "streamrover":
            return True
        lines = [ln for ln in (self.root / "launcher.log").read_text(errors="replace").splitlines()
                 if "standbys warm" in ln]  # fmt: skip
        return bool(lines) and lines[-1].rstrip().endswith(" 2 standbys warm")

    def kill_worker(self) -> tuple[float, set[int]]:
        """SIGKILL local rank 1; returns the time of the kill and the pids of the group it killed."""
        workers = self.workers()
        victim = workers[-1]  # local rank 1
        old = {p.pid for p in workers}
        t0 = time.time()
        victim.send_signal(signal.SIGKILL)
        self.wait(lambda: len(self.workers()) == 2 and not old & {p.pid for p in self.workers()}, 120, "restart")
        return t0, old

    def recovery(self, t0: float, old: set[int]) -> float:
        """Kill to the first optimizer step of the new group (a step of the old one may land just after the kill)."""

        def new_steps() -> list[float]:
            return [t for t, _, pid in self.step_rows()[-50:] if t > t0 and pid not in old]

        self.wait(lambda: bool(new_steps()), 180, "step after the kill")
        return min(new_steps()) - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait()
        if self.master is not None:
            self.master.stop()
        # The agent was SIGKILLed (it frees its snapshot buffers only after a successful run): free them here.
        for leftover in Path("/dev/shm").glob(f"srckpt-*.{self.node_id}-*"):
            leftover.unlink(missing_ok=True)


AGENT_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) (.*)$")
PHASES = re.compile(r"^phase-times rank (\d+) pid (\d+): (.*)$")


def breakdown(job: Job, t0: float, old: set[int]) -> dict[str, float]:
    """Where one recovery's seconds went, from the agent's log lines and the new workers' phase stamps.

    streamrover: detection (kill -> the agent sees the group FAILED), stop (the surviving workers
    terminated), drain (the saver's persist of the dead worker's snapshot), rendezvous (-> workers
    started), hand-off (-> the workers' code runs: a warm standby becomes the worker), process group
    (init_process_group), model + DDP (built, DDP's first parameter broadcast), restore (torch.load; ours:
    attach, i.e. the snapshot loaded, the cursor reset, the state handed to the other ranks: mapped from
    shared memory on rank 0's node, else broadcast), first batch (the data loader's first batch), first step
    (its forward, backward and optimizer step).
    torchrun: its agent logs no times here: "to worker code" covers detection, stop, rendezvous, the
    new processes' start and their imports.
    """
    text = (job.root / "launcher.log").read_text(errors="replace").splitlines()
    events: dict[str, float] = {}
    drain = stop = None
    stamps: dict[str, float] = {}
    for line in text:
        m = AGENT_LINE.match(line)
        if m:
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at < t0 - 0.01:  # asctime has ms resolution
                continue
            msg = m.group(3)
            if "workers FAILED" in msg:
                events.setdefault("detected", at)
            elif (w := re.search(r"workers stopped in ([\d.]+) s, checkpoint saver drained in ([\d.]+) s", msg)):
                events.setdefault("stopped", at)
                stop, drain = float(w.group(1)), float(w.group(2))
            elif "rendezvous done" in msg:
                events.setdefault("rendezvous", at)
            continue
        m = PHASES.match(line)
        if m and int(m.group(2)) not in old:
            for item in m.group(3).split(","):
                name, _, value = item.partition("=")
                with contextlib.suppress(ValueError):  # a line another process's write cut into: not counted
                    stamps[name] = max(stamps.get(name, 0.0), float(value))  # the group waits for its slowest rank
    if not stamps.get("first") or stamps["first"] < t0:
        return {}
    out: dict[str, float] = {}
    if "detected" in events and "rendezvous" in events:
        out["detection"] = events["detected"] - t0
        if stop is not None and drain is not None:
            out["stop workers"], out["saver drain"] = stop, drain
        out["rendezvous"] = events["rendezvous"] - events.get("stopped", events["detected"])
        out["hand-off"] = stamps["imports"] - events["rendezvous"]
    else:
        out["to worker code"] = stamps["imports"] - t0
    out["process group"] = stamps["init_process_group"] - stamps["imports"]
    out["model + DDP"] = stamps["model"] - stamps["init_process_group"]
    restored = stamps.get("attach", stamps.get("torch.load", stamps["model"]))
    out["restore"] = restored - stamps["model"]  # streamrover: attach (load, cursor reset, state to the ranks)
    if "batch" in stamps:  # the first batch read (ours: leased and read from parquet), then its step
        out["first batch"] = stamps["batch"] - restored
        out["first step"] = stamps["first"] - stamps["batch"]
    else:
        out["first step"] = stamps["first"] - restored
    return out


def step_time(rows: list[tuple[float, int]]) -> float:
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows) if b[1] == a[1] + 1]
    return statistics.median(gaps)


def measure_recovery(
    mode: str, root: Path, args: argparse.Namespace
) -> tuple[list[float], float, list[dict[str, float]]]:
    job = Job(mode, root, args)
    try:
        job.wait(lambda: len(job.steps()) >= 2 * args.ckpt_every + 5, 300, "warm-up steps")
        times = []
        parts = []
        for _ in range(args.kills):
            job.wait(job.standbys_warm, 120, "warm standbys")
            t0, old = job.kill_worker()
            times.append(job.recovery(t0, old))
            done = len(job.steps())
            job.wait(lambda d=done: len(job.steps()) >= d + args.ckpt_every + 5, 300, "steps after recovery")
            parts.append(breakdown(job, t0, old))
        return times, step_time(job.steps()), parts
    finally:
        job.stop()


def productive_seconds(rows: list[tuple[float, int, int]]) -> float:
    """Seconds spent on steps that survive in the final model: ML goodput's numerator.

    A step's time is the gap since the previous step of the same process; the first step of a
    restarted group (its gap holds the recovery) counts nothing; steps later rolled back to a
    checkpoint (a step number seen again) are dropped.
    """
    kept: dict[int, float] = {}  # step -> seconds, for the timeline that survives
    prev: tuple[float, int, int] | None = None
    for t, step, pid in rows:
        for s in [s for s in kept if s >= step]:  # rolled back: these steps are redone
            del kept[s]
        kept[step] = t - prev[0] if prev is not None and prev[2] == pid else 0.0
        prev = (t, step, pid)
    return sum(kept.values())


def measure_goodput(mode: str, root: Path, args: argparse.Namespace) -> tuple[float, int, float]:
    """Goodput = seconds of steps that survive / wall seconds, with a SIGKILL every ``fault_every`` s.

    Lost: detection and restart, steps redone after the rollback to the last checkpoint, and the
    restarted group's first step. Checkpoint stalls inside a process count as training time here
    (bench_ckpt measures them). Returns (goodput, faults, mean step seconds).
    """
    job = Job(mode, root / "goodput", args)
    try:
        job.wait(lambda: len(job.steps()) >= 5, 300, "first steps")
        start = job.steps()[0][0]
        faults = 0
        while time.time() < start + args.duration:
            deadline = min(time.time() + args.fault_every, start + args.duration)
            while time.time() < deadline and job.proc.poll() is None:
                time.sleep(0.2)  # the fault schedule is wall-clock by definition
            if time.time() < start + args.duration:
                job.kill_worker()
                faults += 1
        end = start + args.duration
        rows = [r for r in job.step_rows() if r[0] <= end]
        productive = productive_seconds(rows)
        return productive / (end - start), faults, productive / max(len(rows), 1)
    finally:
        job.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--skip-goodput", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 kill each; goodput over 120 s, a fault every 40 s")
    parser.add_argument("--keep", default="", help="run in this directory and keep its logs (default: a temp dir)")
    args, _ = parser.parse_known_args(argv)
    if args.quick:
        args.kills, args.duration, args.fault_every = 1, 120.0, 40.0
    state_mb = (args.hidden * args.hidden * args.layers + 3 * args.hidden) * 4 * 3 / 2**20
    print(
        f"torch recovery benchmark: 2 gloo workers, MLP {args.layers}x{args.hidden} (~{state_mb:.0f} MB with Adam "
        f"state), checkpoint every {args.ckpt_every} steps, {os.cpu_count()} cores"
    )
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = Path(args.keep)
            root.mkdir(parents=True, exist_ok=False)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-torch-")))
        rec: dict[str, tuple[list[float], float, list[dict[str, float]]]] = {}
        for mode in ("torchrun", "streamrover"):
            rec[mode] = measure_recovery(mode, root, args)
            times, clean, parts = rec[mode]
            print(f"  {mode:12s} recovery {statistics.median(times):6.2f} s (runs: "
                  f"{', '.join(f'{t:.2f}' for t in times)}); step {clean * 1000:.0f} ms", flush=True)  # fmt: skip
            names = [n for n in parts[0]] if parts and parts[0] else []
            if names:
                medians = {n: statistics.median(p[n] for p in parts if n in p) for n in names}
                print("    where it goes (medians over the kills): "
                      + ", ".join(f"{n} {v:.3f} s" for n, v in medians.items()), flush=True)  # fmt: skip
        ratio = statistics.median(rec["streamrover"][0]) / statistics.median(rec["torchrun"][0])
        print(f"  recovery ratio dlrover-run / torchrun = {ratio:.2f} (issue 35 goal <= 0.1: "
              f"{'met' if ratio <= 0.1 else 'NOT met'}; load average {load_average()}, judged on a quiet machine)")
        if not args.skip_goodput:
            good: dict[str, float] = {}
            for mode in ("torchrun", "streamrover"):
                good[mode], faults, steady = measure_goodput(mode, root, args)
                print(f"  {mode:12s} goodput {good[mode]:.1%} over {args.duration:.0f} s with {faults} faults "
                      f"(one every {args.fault_every:.0f} s; mean step {steady * 1000:.0f} ms)",
                      flush=True)  # fmt: skip
            print(f"  goodput dlrover-run {good['streamrover']:.1%} (goal >= 90%), "
                  f"ratio to torchrun {good['streamrover'] / max(good['torchrun'], 1e-9):.2f}")  # fmt: skip
    return 0

