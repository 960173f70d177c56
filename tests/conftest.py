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
