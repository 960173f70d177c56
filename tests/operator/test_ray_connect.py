"""Which Ray cluster ``streamrover run --platform ray`` joins (issue 31): the one ``ray start`` started, or a named
one that answers within 30 s, or an error naming the address that does not.

The cluster is a real ``ray start --head`` in a Ray temp directory of the test's own (``RAY_TMPDIR``: Ray records
the running cluster's address there, and every Ray instance makes a ``session_*`` directory there, which is how
"no second Ray instance" is seen). ``ray stop`` would stop every Ray on the machine: the fixture ends the
processes of its own cluster by pid instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.brokers._process import free_port
from tests.helpers import end_processes_under
from tests.operator.runner import RunningJob, ledger_spec

pytestmark = pytest.mark.slow
RECORDS = 2_000


@dataclass
class RayHead:
    address: str
    temp: Path
    env: dict[str, str]

    def sessions(self) -> list[str]:
        return sorted(p.name for p in (self.temp / "ray").glob("session_2*"))


def _ray_env(temp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GRPC_EXPERIMENTS")}
    # binds and advertises 127.0.0.1 only (ENVIRONMENT.md); the temp dir keeps Ray's records the test's own
    return {**env, "RAY_TMPDIR": str(temp), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def ray_head() -> Iterator[RayHead]:
    temp = Path(tempfile.mkdtemp(prefix="rayh"))  # short: Ray's socket paths live under it
    env = _ray_env(temp)
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        subprocess.run([ray, "start", "--head", "--port=0", "--num-cpus=2", "--node-ip-address=127.0.0.1",
                        "--include-dashboard=false", "--disable-usage-stats"], env=env, check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        address = (temp / "ray" / "ray_current_cluster").read_text().strip()
        yield RayHead(address, temp, env)
    finally:
        end_processes_under(temp)
        shutil.rmtree(temp, ignore_errors=True)


def test_run_without_ray_address_joins_the_cluster_ray_start_started(tmp_path: Path, ray_head: RayHead) -> None:
    from tests.trainers.test_single_node import _parquet

    _parquet(tmp_path / "data", RECORDS)
    spec = ledger_spec("joins", str(tmp_path / "data"), RECORDS, tmp_path / "out", nodes=1, nproc_per_node=1)
    before = ray_head.sessions()
    job = RunningJob(tmp_path, spec, env=ray_head.env)
    job.env.pop("RAY_ADDRESS", None)
    job.start(platform="ray")
    try:
        assert job.wait(timeout=300) == 0, job.logs()
        log = (tmp_path / "run.log").read_text()
        assert f"joining the running Ray cluster at {ray_head.address}" in log, log
        assert ray_head.sessions() == before, "a second Ray instance was started beside the running cluster"
        assert "Started a local Ray instance" not in log, log
        assert "Unknown experiment" not in log, "streamrover's GRPC_EXPERIMENTS reached Ray's gRPC core"
        doc = job.status()
        assert doc["phase"] == "succeeded" and doc["platform"] == "ray", doc
        ledger = job.ledger()
        assert ledger is not None and np.all(ledger == 1), job.logs()
    finally:
        job.stop()


def test_an_unreachable_ray_address_fails_within_30_s_naming_it(tmp_path: Path) -> None:
    from tests.trainers.test_single_node import _parquet

    _parquet(tmp_path / "data", 100)
    spec = ledger_spec("no-ray", str(tmp_path / "data"), 100, tmp_path / "out", nodes=1)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    temp = Path(tempfile.mkdtemp(prefix="rayu"))
    job = RunningJob(tmp_path, spec, env={**_ray_env(temp), "RAY_ADDRESS": address})
    started = time.monotonic()
    job.start(platform="ray")
    try:
        try:
            code = job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`streamrover run --platform ray` still waits {time.monotonic() - started:.0f} s after it "
                        f"started, on an address nothing listens on\n{job.logs()}")  # fmt: skip
        took = time.monotonic() - started
        log = (tmp_path / "run.log").read_text()
        assert code == 2 and took < 30, (code, took, log)
        assert f"cannot reach the Ray cluster at {address} (RAY_ADDRESS)" in log, log
        doc = job.status()  # what `streamrover jobs status no-ray` shows
        assert doc["phase"] == "failed" and address in doc["reason"], doc
        print(f"unreachable RAY_ADDRESS -> failed in {took:.1f} s")
    finally:
        job.stop()
        end_processes_under(temp)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("env", [{}, {"TMPDIR": "/tmp/a"}, {"RAY_TMPDIR": "/tmp/b", "TMPDIR": "/tmp/a"}],
                         ids=["default", "tmpdir", "ray-tmpdir"])  # fmt: skip
def test_the_recorded_address_is_looked_for_where_ray_records_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    """``ray start`` with ``$TMPDIR`` set records its address under ``$TMPDIR/ray``; the lookup uses Ray's own rule."""
    from ray._common.utils import get_default_ray_temp_dir

    from streamrover.operator.ray_connect import _ray_temp_dir

    for name in ("RAY_TMPDIR", "TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _ray_temp_dir() == Path(get_default_ray_temp_dir())
