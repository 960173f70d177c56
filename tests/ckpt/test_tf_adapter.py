"""TensorFlow variables adapter (needs tensorflow-cpu: the `tf` extra). Each check runs in its own process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("tf_worker.py"))
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow-cpu is not installed"),
    pytest.mark.timeout(300),
]


def run_worker(*args: str) -> None:
    out = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


@pytest.mark.parametrize("source", ["memory", "storage"])
def test_tf_module_variables_round_trip(root: str, source: str) -> None:
    run_worker(source, root)


def test_keras_model_round_trip_and_mismatch_is_named() -> None:
    run_worker("keras")
