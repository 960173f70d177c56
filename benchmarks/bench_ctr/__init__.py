"""The online CTR job (examples/streaming_ctr): exactly-once throughput vs a hand-written loop; AUC vs River.

Three runs on one tansu broker, in this process's run:

1. **exactly once**: ``streamrover run`` of the example's job (master, one dlrover-run node, two
   DDP workers, leases, acks, flash checkpoints every 20 steps, the ledger) over a topic
   prefilled with ``--records`` records; records/s from its first step to its last;
2. **hand-written** (benchmarks/bench_ctr/plain.py): torchrun, one confluent-kafka consumer per rank
   in one consumer group, the same DeepFM, optimizer and batch, no checkpoints, no exactly-once,
   over the same prefilled topic; the same measure;
3. **paced**: the example as ``make demo`` runs it (no kill) on a live topic written at
   ``--rate`` records/s with one drift: freshness p50/p99 (event time to applied in the model)
   and the progressive AUC, beside the oracle's and beside River's online logistic regression
   (one-hot categoricals, scaled numerics) run progressively over the same records.

Goal: exactly-once records/s >= 0.9 x the hand-written loop's.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
PLAIN = Path(__file__).resolve().with_name("plain.py")


def _river_rows(records: int, seed: int, drift_at: int, window: int) -> np.ndarray:
    """River's LogisticRegression scored progressively (predict, then learn) over the click stream's records."""
    from river import compose, linear_model, optim, preprocessing

    from examples.streaming_ctr import metrics
    from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC, ClickStream

    model = compose.TransformerUnion(
        compose.Select(*CATEGORICAL) | preprocessing.OneHotEncoder(),
        compose.Select(*NUMERIC) | preprocessing.StandardScaler(),
    ) | linear_model.LogisticRegression(optimizer=optim.SGD(0.05))
    stream = ClickStream(seed, (drift_at,))
    n_windows = (records + window - 1) // window
    rows = np.zeros((n_windows, metrics.ROW))
    for start in range(0, records, 4096):
        cols = stream.columns(start, min(start + 4096, records))
        logits = np.empty(len(cols["id"]))
        for i in range(len(logits)):
            x = {**{c: str(cols[c][i]) for c in CATEGORICAL}, **{c: float(cols[c][i]) for c in NUMERIC}}
            p = min(max(model.predict_proba_one(x).get(True, 0.5), 1e-6), 1 - 1e-6)
            logits[i] = math.log(p / (1 - p))
            model.learn_one(x, bool(cols["clicked"][i]))
        rows += metrics.window_rows(cols["id"] // window, logits, cols["true_logit"], cols["clicked"].astype(float),
                                    np.zeros(len(logits)), 0.0, n_windows)  # fmt: skip
    return rows


def _plain(bootstrap: str, topic: str, records: int, work: Path, batch: int) -> dict[str, float]:
    from streamrover.testing.procs import python_env

    env = {**python_env(), "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(PLAIN), "--bootstrap", bootstrap, "--topic", topic, "--records", str(records),
           "--batch-size", str(batch), "--out", str(work)]  # fmt: skip
    with open(work / "plain.log", "ab") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=900)
    return dict(json.loads((work / "plain.json").read_text()))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=80_000, help="records of the prefilled topic (throughput runs)")
    p.add_argument("--paced-records", type=int, default=60_000)
    p.add_argument("--rate", type=float, default=1_500.0, help="records/s of the paced run's producer")
    p.add_argument("--quick", action="store_true", help="a smoke-sized run")
    p.add_argument("--throughput-only", action="store_true", help="runs 1 and 2 only (no paced run, no River)")
    args, _ = p.parse_known_args(argv)
    if args.quick:
        args.records, args.paced_records = 20_000, 20_000
    sys.path.insert(0, str(ROOT))
    from examples.streaming_ctr import metrics
    from examples.streaming_ctr.clickstream import ClickStream
    from examples.streaming_ctr.demo import DemoConfig, run_demo
    from examples.streaming_ctr.produce import ensure_topic, produce
    from tests.brokers.tansu import TansuBroker

    work = Path(tempfile.mkdtemp(prefix="bench-ctr-"))
    quiet = Console(file=io.StringIO())
    broker = TansuBroker(work / "tansu")
    broker.start()
    try:
        seed, drift = 7, args.paced_records * 2 // 3
        ensure_topic(broker.bootstrap, "prefilled", 2)
        t = time.monotonic()
        produce(broker.bootstrap, "prefilled", ClickStream(seed, ()), args.records, 1e9, 2)
        print(f"prefilled {args.records:,} records in {time.monotonic() - t:.1f} s", flush=True)
        eo, _ = run_demo(DemoConfig(records=args.records, drift_at=args.records, kill_at=None, oracle=False,
                                    produce=False, bootstrap=broker.bootstrap, topic="prefilled",
                                    # training alone: no model server beside it, a checkpoint every 20 steps
                                    serve=False, ckpt_every=20,
                                    workdir=work / "exactly-once"), quiet, live=False)  # fmt: skip
        print(f"exactly once: {eo.records_per_second:,.0f} records/s (ledger exact: {eo.exact})", flush=True)
        plain = _plain(broker.bootstrap, "prefilled", args.records, work, 256)
        plain_rate = plain["records"] / plain["seconds"]
        print(f"hand-written torchrun + confluent-kafka: {plain_rate:,.0f} records/s", flush=True)
        if args.throughput_only:
            paced = None
        else:
            paced_cfg = DemoConfig(records=args.paced_records, drift_at=drift, rate=args.rate, kill_at=None,
                                   serve=False,  # event to applied here; `python -m benchmarks serving`: to served
                                   bootstrap=broker.bootstrap, topic="paced", workdir=work / "paced")  # fmt: skip
            paced, paced_dir = run_demo(paced_cfg, quiet, live=False)
            ours = metrics.merged(np.load(paced_dir / "out" / "windows.npy"))
            t = time.monotonic()
            river_rows = _river_rows(args.paced_records, seed, drift, 5_000)
            river = metrics.merged(river_rows)
            river_s = time.monotonic() - t
    finally:
        broker.stop()
    ratio = eo.records_per_second / plain_rate
    print(f"\nthroughput, records/s over {args.records:,} records (2 ranks, batch 256 per rank):")
    print(f"  exactly once (streamrover run, dlrover-run)  {eo.records_per_second:10,.0f}")
    print(f"  hand-written (torchrun, confluent-kafka)     {plain_rate:10,.0f}")
    print(f"  ratio {ratio:.2f} (goal >= 0.9)")
    if paced is None:
        return 0 if eo.exact else 1
    print(f"\nprogressive AUC over {args.paced_records:,} paced records ({args.rate:,.0f}/s, drift at {drift:,}):")
    print(f"  streamrover DeepFM   {ours.auc:.4f}  (log loss {ours.logloss:.4f})")
    print(f"  River LogisticRegression {river.auc:.4f}  (log loss {river.logloss:.4f}; "
          f"{args.paced_records / river_s:,.0f} records/s, one process)")
    print(f"  oracle               {ours.oracle_auc:.4f}  (log loss {ours.oracle_logloss:.4f})")
    print(f"  DeepFM / River {ours.auc / river.auc:.3f}; DeepFM / oracle {ours.auc_ratio:.3f}; "
          f"before the drift {paced.before_ratio:.3f}, at the end {paced.final_ratio:.3f}")
    print(f"\nfreshness (event time -> applied in the model), paced run: p50 {paced.fresh_p50_ms / 1000:.2f} s, "
          f"p99 {paced.fresh_p99_ms / 1000:.2f} s")
    return 0 if eo.exact and paced.exact else 1
