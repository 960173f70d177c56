"""Shared fixtures: a real master process per test."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.testing.procs import MasterProcess

pytest_plugins = ["tests.brokers.fixtures"]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    m = MasterProcess(tmp_path / "master", lease_ttl=2.0)
    m.start()
    try:
        yield m
    finally:
        m.stop()


_run_temp: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """What the run's processes write to temp goes into one directory of this run, removed when it ends.

    Flink's mini cluster, Spark's block managers, the JVMs' extracted native libraries, SeaweedFS's logs and
    torchelastic's run dirs otherwise stay in /tmp after every run (about 140 MB a run, on the machine that runs
    CI). Python and Go read ``$TMPDIR``; a JVM reads ``java.io.tmpdir`` (Flink's ``io.tmp.dirs`` and Spark's
    ``spark.local.dir`` default to it). pytest's own ``tmp_path`` directories stay where they were: it keeps the
    last three runs' for a look after a failure.
    """
    if _run_temp:
        return
    base = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", base)
    run = tempfile.mkdtemp(prefix="sr-", dir=base)  # short: Ray's socket paths live under it
    _run_temp.append(run)
    os.environ["TMPDIR"] = run
    tempfile.tempdir = None  # Python's own temp files follow $TMPDIR from here on
    java = os.environ.get("JAVA_TOOL_OPTIONS", "")
    os.environ["JAVA_TOOL_OPTIONS"] = f"{java} -Djava.io.tmpdir={run}".strip()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _run_temp:
        shutil.rmtree(_run_temp.pop(), ignore_errors=True)


_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is not a passing test: any skip fails the run, naming what was skipped."""
    if _skipped and exitstatus == 0:
        print(f"\n{len(_skipped)} test(s) skipped, which this project counts as failures: " + ", ".join(_skipped))
        session.exitstatus = 1


@pytest.fixture(scope="session", autouse=True)
def _free_leaked_shared_memory() -> Iterator[None]:
    """Trainers SIGKILLed on purpose leave checkpoint buffers in /dev/shm; free the ones this run created."""
    shm = Path("/dev/shm")
    before = set(shm.glob("srckpt-*")) if shm.is_dir() else set()
    yield
    in_use = _mapped_checkpoint_buffers()  # a live process's buffers (another run's trainer, saver or bench)
    served = _served_namespaces()  # a live saver owns its namespace's buffers (it frees orphans when it exits)
    # A buffer written in the last seconds may belong to a concurrent run that has created it and not yet
    # mapped it (or whose trainer restarts to map it again): spare it, at the cost of rarely leaving one.
    recent = time.time() - 10.0
    for leftover in set(shm.glob("srckpt-*")) - before if shm.is_dir() else ():
        try:
            namespace = re.sub(r"-r\d+-b\d+(-tail)?$", "", leftover.name.removeprefix("srckpt-"))
            if str(leftover) not in in_use and namespace not in served and leftover.stat().st_mtime < recent:
                leftover.unlink(missing_ok=True)
        except FileNotFoundError:
            continue


def _served_namespaces() -> set[str]:
    """Checkpoint namespaces whose saver listens now (its abstract socket, ``@streamrover-ckpt-NS``).

    Between a trainer's death and its restart nobody maps its buffers (a chief restarted by tf-ps-run,
    a worker group restarted by its agent): the saver that persisted them still serves the namespace.
    """
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()
    except OSError:
        return set()
    prefix = "@streamrover-ckpt-"
    return {re.sub(r"[^A-Za-z0-9_.-]", "_", f.removeprefix(prefix)) for line in lines
            for f in line.split()[7:8] if f.startswith(prefix)}  # fmt: skip


def _mapped_checkpoint_buffers() -> set[str]:
    """Paths of checkpoint buffers that some live process maps: not leaked, whoever created them."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/srckpt-")
            if at >= 0:
                mapped.add(line[at:].removesuffix(" (deleted)"))
    return mapped
