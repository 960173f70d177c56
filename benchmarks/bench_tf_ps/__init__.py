"""TF parameter-server training: throughput through shards vs tf.data, and recovery after a PS SIGKILL.

Both sides run the same chief (``benchmarks/bench_tf_ps/chief.py``: y = wx + b plus a sharded
embedding of ``--buckets`` x ``--dim``, Adagrad) under the same ``tf-ps-run`` launcher, 2 PS and
2 workers on this machine:

* **throughput**: records/s of :class:`PSTrainer` fed by leased shards of a parquet dataset
  through a real job master (acks after fetch, flash checkpoints every ``--ckpt-every`` steps) vs
  the same coordinator loop reading the same columns with ``tf.data`` directly (no shard service,
  no checkpoints). Goal: >= 0.8.
* **recovery**: SIGKILL of a parameter server → the next step completed after the launcher
  restarted it and the chief: PSTrainer restoring its flash checkpoint (shared memory) vs the
  tf.data loop restoring a ``tf.train.CheckpointManager`` checkpoint from disk. Goal: <= 1/3.

Ratios are streamrover over the peer, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess, python_env

CHIEF = Path(__file__).resolve().with_name("chief.py")


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for(what: str, predicate: Any, timeout: float) -> Any:
    give_up = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > give_up:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling an events file written by another process


class Run:
    """One tf-ps-run job of the bench chief."""

    def __init__(self, root: Path, name: str, mode: str, data: Path, args: argparse.Namespace) -> None:
        self.root = root / name
        self.root.mkdir(parents=True)
        self.events = self.root / "events.jsonl"
        self.status = self.root / "status.json"
        self.master = MasterProcess(self.root / "master", lease_ttl=10.0)
        self.master.start()
        with ShardClient(self.master.address, token=self.master.token, heartbeat=False) as admin:
            admin.register_dataset(DatasetSpec("bench", str(data), records_per_shard=args.records_per_shard))
        script = [str(CHIEF), "--mode", mode, "--data", str(data), "--batch-size", str(args.batch_size),
                  "--buckets", str(args.buckets), "--dim", str(args.dim),
                  "--ckpt-every", str(args.ckpt_every)]  # fmt: skip
        if mode == "tfdata" and args.ckpt_manager:
            script += ["--ckpt-manager", str(self.root / "tf-ckpt")]
        cmd = [sys.executable, "-m", "streamrover.cli", "tf-ps-run", "--ps", "2", "--workers", "2",
               "--shard-service", self.master.address, "--token", self.master.token,
               "--ckpt-dir", str(self.root / "ckpt"), "--ckpt-job", f"bench{os.getpid()}{name}",
               "--log-dir", str(self.root / "logs"), "--status-file", str(self.status),
               "--events", str(self.events), *script]  # fmt: skip
        env = python_env()
        env["PYTHONPATH"] = os.pathsep.join([str(CHIEF.parents[2]), env.get("PYTHONPATH", "")])
        with open(self.root / "launcher.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill_ps(self) -> float:
        pid = json.loads(self.status.read_text())["ps"][0]
        at = time.time()
        os.kill(int(pid), signal.SIGKILL)
        return at

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, ProcessLookupError, TypeError):
            os.kill(int(json.loads(self.status.read_text())["chief"]), signal.SIGKILL)
        self.master.stop()


def throughput(root: Path, name: str, mode: str, data: Path, args: argparse.Namespace) -> float:
    run = Run(root, name, mode, data, args)
    code = run.wait(timeout=1800)
    done = [e for e in _events(run.events) if e["event"] == "done"]
    if code != 0 or not done:
        raise RuntimeError(f"{name} failed (exit {code}); see {run.root}")
    resumed = [e for e in _events(run.events) if e["event"] == "resumed"]
    # from the first completed step (start-up excluded on both sides) to the end
    return float(args.records / (done[-1]["t"] - resumed[0]["t"]))


def recovery(root: Path, name: str, mode: str, data: Path, args: argparse.Namespace) -> float:
    run = Run(root, name, mode, data, args)
    try:
        _wait_for(f"{name}: checkpoints", lambda: len([e for e in _events(run.events) if e["event"] == "checkpoint"])
                  >= 3, 900)  # fmt: skip

        # both sides restart the PS and the chief in warm standby interpreters: kill once they are warm
        def warm() -> bool:
            if run.proc.poll() is not None:
                raise RuntimeError(f"{name} ended before its standbys were warm: run with more --records")
            return int(json.loads(run.status.read_text()).get("standby_ready", 0)) >= 2

        _wait_for(f"{name}: warm standbys", warm, 900)
        killed = run.kill_ps()
        resumed = _wait_for(f"{name}: a step after the PS loss", lambda: [
            e for e in _events(run.events) if e["event"] == "resumed" and e["t"] > killed], 900)  # fmt: skip
        return float(resumed[0]["t"] - killed)
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--records-per-shard", type=int, default=5_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--buckets", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="400k records, a 20k x 8 embedding")
    parser.add_argument("--only", choices=["throughput", "recovery"], default=None, help="run one half")
    parser.add_argument("--keep", default="", help="run in this directory and keep its logs (default: a temp dir)")
    args, _ = parser.parse_known_args(argv)
    if args.quick:
        args.records, args.buckets, args.dim = 400_000, 20_000, 8
    state_mb = args.buckets * args.dim * 4 * 2 / 2**20
    print(f"TF-PS benchmark: 2 PS + 2 workers, {args.records:,} records, batch {args.batch_size}, embedding "
          f"{args.buckets:,} x {args.dim} (~{state_mb:.0f} MB with Adagrad slots), {os.cpu_count()} cores")  # fmt: skip
    with contextlib.ExitStack() as stack:
        if args.keep:
            root = Path(args.keep)
            root.mkdir(parents=True, exist_ok=False)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tfps-")))
        data = root / "data"
        data.mkdir()
        ids = np.random.default_rng(0).permutation(args.records)
        x = ((ids * 7919) % 2000) / 1000.0 - 1.0
        for i, part in enumerate(np.array_split(np.arange(args.records), 4)):
            table = pa.table({"id": ids[part], "x": x[part], "y": 3.0 * x[part] + 1.0})
            pq.write_table(table, data / f"part-{i}.parquet", row_group_size=5_000)
        args.ckpt_manager = False
        if args.only != "recovery":
            peer = throughput(root, "tfdata", "tfdata", data, args)
            ours = throughput(root, "shards", "shards", data, args)
            print(f"  throughput: shards {ours:,.0f} records/s, tf.data {peer:,.0f} records/s, "
                  f"ratio {ours / peer:.2f} (goal >= 0.8)", flush=True)  # fmt: skip
        if args.only == "throughput":
            return 0
        args.ckpt_manager = True
        peer_rec = recovery(root, "rec-tfdata", "tfdata", data, args)
        ours_rec = recovery(root, "rec-shards", "shards", data, args)
        print(f"  recovery after a PS SIGKILL: flash {ours_rec:.2f} s, CheckpointManager {peer_rec:.2f} s, "
              f"ratio {ours_rec / peer_rec:.2f} (goal <= 0.33)", flush=True)  # fmt: skip
    return 0

