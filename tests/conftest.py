"""Shared fixtures: a real master process per test."""

from __future__ import annotations

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
    # A buffer written in the last seconds may belong to a concurrent run that has created it and not yet
    # mapped it (or whose trainer restarts to map it again): spare it, at the cost of rarely leaving one.
    recent = time.time() - 10.0
    for leftover in set(shm.glob("srckpt-*")) - before if shm.is_dir() else ():
        try:
            if str(leftover) not in in_use and leftover.stat().st_mtime < recent:
                leftover.unlink(missing_ok=True)
        except FileNotFoundError:
            continue


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
