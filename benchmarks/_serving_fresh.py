"""Freshness from event to *served* (part 3 of bench_serving): a paced stream, the trainer, the exporter, KServe.

Records "arrive" at ``rate`` records/s (their event time is their arrival time); the trainer (the flagship's
DeepFM, Adam, ``RowTracker(sticky=True)``) trains each batch as soon as it has arrived, checkpoints every
``every`` steps and exports every durable checkpoint; the model server (scripts/build-serving-venv.sh) polls
the repository every ``poll`` s and a client asks it for its version every 20 ms. A record is *served* when
the first version holding it is first answered; *applied* when its step's update is in the trainer's model.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _client(url: str, seen: dict[int, float], stop: threading.Event, request: bytes) -> None:
    while not stop.wait(0.02):  # a client's request interval
        try:
            req = urllib.request.Request(url, request, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as response:
                seen.setdefault(int(json.loads(response.read())["model_version"]), time.time())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            continue  # not up yet


def measure(rate: float, seconds: float, every: int, batch: int = 512, poll: float = 0.1) -> dict[str, Any]:
    """Run the paced pipeline; freshness quantiles (s) of records served and applied, and what was seen."""
    import torch

    from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
    from examples.streaming_ctr.model import DeepFM
    from streamrover.ckpt import Checkpointer, RetentionPolicy, namespace_for, purge_shared_memory
    from streamrover.ckpt.torch_adapter import TorchCheckpoint
    from streamrover.serving import ExportConfig, RowTracker, TorchExporter
    from streamrover.serving.tables import TOUCHED_KEY

    venv = subprocess.run(["bash", str(ROOT / "scripts" / "build-serving-venv.sh")], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="bench-fresh-"))
    ckpt_url, repo = str(tmp / "ckpt"), str(tmp / "repo")
    torch.manual_seed(0)
    model = DeepFM()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    tracker = RowTracker(model, sticky=True)
    example = (torch.zeros(1, len(CATEGORICAL), dtype=torch.int64), torch.zeros(1, len(NUMERIC)))
    exporter = TorchExporter(ExportConfig(repo, name="ctr", keep_last=1000), ckpt_url, DeepFM, example,
                             input_names=["cats", "nums"], output_names=["logit"], tables=tracker.params)  # fmt: skip
    saved_at: dict[int, float] = {}
    durable_at: dict[int, float] = {}

    def on_durable(step: int) -> None:
        durable_at[step] = time.time()
        exporter.on_durable(step)

    checkpointer = Checkpointer(ckpt_url, saver="thread", retention=RetentionPolicy(keep_last=3),
                                on_durable=on_durable)  # fmt: skip
    ckpt = TorchCheckpoint(checkpointer, model, optimizer)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([venv, "-m", "streamrover.serving.server", "--repository", repo, "--name", "ctr",
                               "--http-port", str(port), "--poll", str(poll)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    seen: dict[int, float] = {}
    stop = threading.Event()
    body = json.dumps({"instances": [{"cats": [1] * len(CATEGORICAL), "nums": [0.0] * len(NUMERIC)}]}).encode()
    client = threading.Thread(target=_client, args=(f"http://127.0.0.1:{port}/v1/models/ctr:predict", seen, stop,
                                                    body), daemon=True)  # fmt: skip
    client.start()
    gen = torch.Generator().manual_seed(1)
    steps = int(seconds * rate / batch)
    event_start, applied = np.zeros(steps + 1), np.zeros(steps + 1)
    try:
        ckpt.save(0, extra={TOUCHED_KEY: tracker.state()})  # version 0: the server is up and serving before t0
        give_up = time.monotonic() + 120
        while 0 not in seen and time.monotonic() < give_up:
            time.sleep(0.05)  # the server's start (bounded)
        t0 = time.time() + 0.5
        for step in range(1, steps + 1):
            arrived = t0 + step * batch / rate
            time.sleep(max(0.0, arrived - time.time()))  # the stream's pace: the batch has not arrived before
            cats = torch.randint(0, 1 << 40, (batch, len(CATEGORICAL)), generator=gen)
            nums, y = torch.randn(batch, len(NUMERIC), generator=gen), (torch.rand(batch, generator=gen) < 0.2).float()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(cats, nums), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tracker.step_done(step)
            event_start[step], applied[step] = t0 + (step - 1) * batch / rate, time.time()
            if step % every == 0:
                saved_at[step] = time.time()
                ckpt.save(step, extra={TOUCHED_KEY: tracker.state()})
        last = steps - steps % every
        give_up = time.monotonic() + 60
        while last not in seen and time.monotonic() < give_up:
            time.sleep(0.05)  # the last checkpoint's version reaching the client (bounded)
    finally:
        stop.set()
        exporter.close()
        checkpointer.close()
        server.kill()
        server.wait()
        purge_shared_memory(namespace_for(ckpt_url))
    from streamrover.serving import ModelRepository

    published = {v: ModelRepository(repo, "ctr").info(v).exported_at for v in durable_at if v > 0}
    stages = {  # median seconds per stage, over the versions that went through all of them
        "save->durable": [durable_at[v] - saved_at[v] for v in published if v in saved_at],
        "durable->published": [published[v] - durable_at[v] for v in published],
        "published->answered": [seen[v] - published[v] for v in published if v in seen],
    }
    shutil.rmtree(tmp, ignore_errors=True)
    served_s, applied_s = [], []
    versions = sorted(seen)
    for step in range(1, last + 1):
        events = event_start[step] + np.arange(batch) / rate
        applied_s.append(applied[step] - events)
        first = next((v for v in versions if v >= step), None)
        if first is not None:
            served_s.append(seen[first] - events)
    served, applied_all = np.concatenate(served_s), np.concatenate(applied_s)
    return {"served_p50": float(np.quantile(served, 0.5)), "served_p99": float(np.quantile(served, 0.99)),
            "applied_p50": float(np.quantile(applied_all, 0.5)), "applied_p99": float(np.quantile(applied_all, 0.99)),
            "versions_seen": len([v for v in versions if v > 0]), "checkpoints": last // every, "steps": steps,
            "stages": {k: float(np.median(v)) if v else float("nan") for k, v in stages.items()}}  # fmt: skip
