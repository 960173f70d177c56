"""Run the example end to end on this machine: a job master, a parquet dataset, dlrover-run with two workers.

python examples/torch_ddp/run_demo.py [--rows 50000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess, python_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=50_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        x = np.random.default_rng(0).uniform(-1, 1, args.rows)
        (root / "data").mkdir()
        pq.write_table(pa.table({"x": x, "y": 3 * x + 1}), root / "data" / "part-0.parquet", row_group_size=5_000)
        with MasterProcess(root / "master") as master:
            with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
                admin.register_dataset(DatasetSpec("clicks", str(root / "data"), records_per_shard=2_000))
            cmd = [
                str(Path(sys.executable).parent / "dlrover-run"), "--nnodes", "1", "--nproc-per-node", "2",
                "--max-restarts", "3", "--rdzv-backend", "streamrover", "--rdzv-id", "demo", "--local-addr",
                "127.0.0.1", "--shard-service", master.address, "--token", master.token,
                "--ckpt-dir", str(root / "ckpt"), str(Path(__file__).with_name("train.py")), "--dataset", "clicks",
            ]  # fmt: skip
            code = subprocess.run(cmd, env=python_env()).returncode
            with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
                committed, _ = admin.get_cursor()
            print(f"dlrover-run exited {code}; committed cursor holds {committed.size():,} of {args.rows:,} records")
            return code


if __name__ == "__main__":
    sys.exit(main())
