"""Shared fixtures: a real master process per test."""

from __future__ import annotations

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
