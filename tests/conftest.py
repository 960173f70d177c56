"""Shared fixtures: a real master process per test."""

from __future__ import annotations

import re
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
    served = _served_namespaces()  # a live saver owns its namespace's buffers (it frees orphans when it exits)
    # A buffer written in the last seconds may belong to a concurrent run that has created it and not yet
    # mapped it (or whose trainer restarts to map it again): spare it, at the cost of rarely leaving one.
    recent = time.time() - 10.0
    for leftover in set(shm.glob("srckpt-*")) - before if shm.is_dir() else ():
        try:
            namespace = re.sub(r"-r\d+-b\d+$", "", leftover.name.removeprefix("srckpt-"))
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
