"""Makes the broker fixtures available to tests/brokers/ even before the top-level conftest registers them."""

from __future__ import annotations

import pytest

_PLUGIN = "tests.brokers.fixtures"


def pytest_configure(config: pytest.Config) -> None:
    # If tests/conftest.py already has pytest_plugins = ["tests.brokers.fixtures"], it is registered under
    # that name and this does nothing; fixtures are never defined twice (which would start two brokers).
    if not config.pluginmanager.has_plugin(_PLUGIN):
        config.pluginmanager.import_plugin(_PLUGIN)
