"""The real serving engine: KServe's ModelServer (its own venv) loads versions as trainers publish them.

A trainer publishes versions 10 (base) and 20 (delta); the server starts on that repository; a second
trainer run goes on to 40 while the test queries the server. Each checkpoint N must be answered as version
N within ``FRESH_BOUND`` seconds of becoming durable, and the server's predictions must equal the torch
model of checkpoint N within ``ATOL`` (float32 ONNX vs torch on CPU: the same arithmetic, reordered).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import wait_until
from tests.serving.test_export import REPO_ROOT, checkpoint_state, dirs, savers, train  # noqa: F401
from tests.serving.trainer_proc import TinyCtr

torch = pytest.importorskip("torch")

FRESH_BOUND = 10.0  # seconds from a checkpoint's durability to the server answering with its version
POLL = 0.2  # the server's repository poll interval
ATOL = 1e-5
IDS = (np.arange(48, dtype=np.int64).reshape(16, 3) * 7) % 512


@pytest.fixture(scope="module")
def serving_python() -> str:
    """The serving venv's python (built once per machine by scripts/build-serving-venv.sh; make setup builds it)."""
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "build-serving-venv.sh")], capture_output=True,
                          text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, f"scripts/build-serving-venv.sh failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(serving_python: str, dirs: tuple[str, str], tmp_path: Path) -> Iterator[str]:  # noqa: F811
    """Start the model server on the test's repository once it holds a version; yields its base URL."""
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([serving_python, "-m", "streamrover.serving.server", "--repository", dirs[1], "--name",
                             "tiny", "--http-port", str(port), "--poll", str(POLL)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        log.close()


def predict(url: str) -> tuple[int, np.ndarray] | None:
    body = json.dumps({"instances": [{"ids": row.tolist()} for row in IDS]}).encode()
    request = urllib.request.Request(f"{url}/v1/models/tiny:predict", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            doc = json.loads(response.read())
    except (urllib.error.URLError, ConnectionError):
        return None  # not up yet
    return int(doc["model_version"]), np.asarray(doc["predictions"], dtype=np.float32)


def expected(ckpt: str, version: int) -> np.ndarray:
    _manifest, state = checkpoint_state(ckpt, version)
    model = TinyCtr()
    model.load_state_dict(state["model"])  # type: ignore[arg-type]
    with torch.no_grad():
        return np.asarray(model(torch.from_numpy(IDS)).numpy())


def test_server_answers_each_durable_checkpoint_within_bound(dirs: tuple[str, str], savers: set[int],  # noqa: F811
                                                             server: str, tmp_path: Path) -> None:  # fmt: skip
    ckpt, repo = dirs
    train(ckpt, repo, savers, "--steps", "20", "--base-every", "4")
    wait_until(lambda: (predict(server) or (0, None))[0] == 20, 60, "the server answering with version 20")

    out = tmp_path / "trainer.out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(out, "w") as fh:
        trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("trainer_proc.py")), "--ckpt", ckpt,
                                    "--repo", repo, "--steps", "40", "--base-every", "4"], env=env, stdout=fh,
                                   stderr=subprocess.DEVNULL)  # fmt: skip
        seen: dict[int, tuple[float, np.ndarray]] = {}
        give_up = time.monotonic() + 120
        try:
            while 40 not in seen:  # query as a client would (every 50 ms); note when each version is first answered
                assert time.monotonic() < give_up, f"version 40 never answered; seen {sorted(seen)}"
                answer = predict(server)
                assert answer is not None, "the server stopped answering"
                seen.setdefault(answer[0], (time.time(), answer[1]))
                assert trainer.poll() in (None, 0), "the trainer failed"
                time.sleep(0.05)  # the client's request interval (not a synchronisation)
        finally:
            trainer.wait(timeout=120)
    durable_at = {}
    for line in out.read_text().splitlines():
        word, *rest = line.split()
        if word == "durable_at":
            durable_at[int(rest[0])] = float(rest[1])
        elif word == "saver":
            savers.add(int(rest[0]))
    assert set(durable_at) == {30, 40}
    for version, (at, scores) in seen.items():
        np.testing.assert_allclose(scores, expected(ckpt, version), rtol=0, atol=ATOL)
        if version in durable_at:
            lag = at - durable_at[version]
            assert lag <= FRESH_BOUND, f"version {version} answered {lag:.2f} s after its checkpoint was durable"
    print(f"durable->served: { {v: round(seen[v][0] - durable_at[v], 3) for v in durable_at if v in seen} }")
