"""``streamrover status`` piped to a log stays readable (issue 13, item 4): whole headers, whole names."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess, python_env
from tests.helpers import wait_until, write_parquet_dataset

HEADERS = ["name", "kind", "partitions", "records", "todo", "leased", "acked", "committed", "records acked",
           "records committed", "lag", "time skew", "dead letters", "state", "worker", "leases",
           "last seen"]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in python_env().items() if k not in ("COLUMNS", "LINES")}


def _status_through_a_pipe(master: MasterProcess, log: Path, *extra: str) -> str:
    """``streamrover status | cat > log`` in a shell, as a cron job or a CI step runs it (no terminal, no COLUMNS)."""
    env = _env()
    cmd = [sys.executable, "-m", "streamrover.cli", "status", "--master", master.address, "--token", master.token,
           *extra]  # fmt: skip
    subprocess.run(f"{shlex.join(cmd)} | cat > {shlex.quote(str(log))}", shell=True, check=True, env=env,
                   timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    return log.read_text()


def test_status_piped_to_a_log_keeps_its_headers_and_names(tmp_path: Path, master: MasterProcess) -> None:
    write_parquet_dataset(tmp_path / "data", 2_000, files=2, row_group_size=500)
    name = "clicks-from-the-eu-west-impressions-topic"
    with ShardClient(master.address, token=master.token, name="trainer-rank0@gpu-node-0017.example") as w:
        w.register_dataset(DatasetSpec(name, str(tmp_path / "data"), records_per_shard=250))
        w.join()
        _, shards = w.lease(name, max_shards=1)
        shards[0].ack(shards[0].lease.end, wait=True)
        out = _status_through_a_pipe(master, tmp_path / "status.log")
        lines = out.splitlines()
        header_text = "\n".join(lines)
        for header in HEADERS:
            assert header in header_text, f"header {header!r} is cut in the piped status:\n{out}"
        assert any(name in line for line in lines), f"the dataset name is cut:\n{out}"
        assert any(w.worker_id in line and "trainer-rank0@gpu-node-0017.example" in line for line in lines), out
        assert "…" not in out, f"nothing may be elided:\n{out}"
        assert "\x1b[" not in out, "no terminal escapes in a log"
        assert any("250" in line and name in line for line in lines), "the counts sit on the dataset's line"


def test_status_watch_into_a_log_prints_one_view_per_interval(tmp_path: Path, master: MasterProcess) -> None:
    log = tmp_path / "watch.log"
    cmd = [sys.executable, "-m", "streamrover.cli", "status", "--master", master.address, "--token", master.token,
           "--watch", "0.2"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: log.read_text().count("records/s") >= 3, 60, "three views in the log")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert text.count("records committed") >= 3 and "\x1b[" not in text, text[-2000:]
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text, re.M), "each view is timestamped"
