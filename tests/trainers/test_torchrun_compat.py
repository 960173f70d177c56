"""A torchrun DDP script not written for streamrover runs under dlrover-run with the flags it used with torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrover.testing.procs import python_env
from streamrover.trainers.torch.run import malloc_tunables, parse_args

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parent / "plain_ddp.py"
DLROVER_RUN = Path(sys.executable).parent / "dlrover-run"


def _run(launcher: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    cmd = [*launcher, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "2",
           "--monitor-interval", "0.2", str(SCRIPT), "--steps", "40", "--out", str(out)]  # fmt: skip
    return subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=240)


def test_plain_ddp_script_runs_under_dlrover_run_as_under_torchrun(tmp_path: Path) -> None:
    torchrun = _run([sys.executable, "-m", "torch.distributed.run"], tmp_path / "torchrun")
    ours = _run([str(DLROVER_RUN)], tmp_path / "dlrover")
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert ours.returncode == 0, ours.stderr[-3000:]
    for rank in (0, 1):
        theirs = (tmp_path / "torchrun" / f"done-{rank}").read_text().split()
        mine = (tmp_path / "dlrover" / f"done-{rank}").read_text().split()
        assert mine[:3] == theirs[:3] == ["2", str(rank), "0"]  # world size, local rank, restart count
        assert abs(float(mine[3]) - float(theirs[3])) < 1e-4, "same script, same data, same result"
        tunables, advised = (tmp_path / "dlrover" / f"malloc-{rank}").read_text().split()
        assert "glibc.malloc.hugetlb=1" in tunables.split(":"), "dlrover-run's workers: malloc advises huge pages"
        if "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            assert advised == "1", "a 16 MB tensor's mapping may take 2 MB pages (a faster teardown at a restart)"


def test_malloc_tunables_add_huge_pages_unless_set() -> None:
    assert malloc_tunables(None) == "glibc.malloc.hugetlb=1"
    assert malloc_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert malloc_tunables("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0", "the user's choice stands"


def test_torchrun_flags_keep_their_meaning() -> None:
    args = parse_args(["--nnodes", "1:3", "--nproc-per-node", "4", "--max-restarts", "5", "--rdzv-backend",
                       "streamrover", "--rdzv-id", "j", "--shard-service", "127.0.0.1:7070", "--token", "t",
                       "--ckpt-dir", "/tmp/c", "--monitor-interval", "0.5", "train.py", "--lr", "0.1"])  # fmt: skip
    assert (args.nnodes, args.nproc_per_node, args.max_restarts, args.monitor_interval) == ("1:3", "4", 5, 0.5)
    assert args.rdzv_endpoint == "127.0.0.1:7070" and "token=t" in args.rdzv_conf
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "0.1"]
    standalone = parse_args(["--standalone", "--nproc-per-node", "2", "train.py"])
    assert standalone.rdzv_backend == "c10d"
