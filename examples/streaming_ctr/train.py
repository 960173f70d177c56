"""The online CTR trainer: DeepFM from a Kafka click stream under ``dlrover-run``, exactly once, validated as it goes.

Each rank leases shards of the ``clicks`` dataset through :class:`~streamrover.trainers.torch.StreamSession`.
Per step: the batch is **scored before it is trained on** (the forward pass of the step is taken
with the weights as they were before its update), then one Adam step (its gradient is the
mean over the step's records of all ranks: the session weighs each rank's share before DDP averages;
a rank without records steps at once with an empty batch). Then every rank's records of the step (id,
score, oracle score, label, event time) are gathered on every rank and applied to the exactly-once state in the model
(examples/streaming_ctr/model.py): the ledger, the window rows of progressive validation and
the freshness histogram (event time to the moment the step's update is in the model). The
session acks the step's records and checkpoints every ``STREAMROVER_CKPT_EVERY`` steps.

Rank 0 writes ``metrics.json`` (the windows' figures, freshness, the ledger's counts) about once a
second for a live view, and at the end ``ledger.npy``, ``windows.npy``, ``freshness.npy``.
Training ends once the ledger holds ``--records`` records.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script by dlrover-run: the repo's root

import streamrover.trainers.torch as srt
from examples.streaming_ctr import metrics
from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC, ClickStream
from examples.streaming_ctr.model import CtrState, DeepFM, features
from streamrover.serving import ExportConfig, RowTracker, TorchExporter
from streamrover.shard_service import ShardServiceError

COLUMNS = ["id", *CATEGORICAL, *NUMERIC, "event_ms", "clicked"]
ORACLE_INPUT = ("id", *CATEGORICAL, *NUMERIC)
_GATHERED = 6  # id, logit, oracle logit, clicked, event_ms, applied_ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="clicks")
    p.add_argument("--records", type=int, required=True, help="the stream's length: training ends when all are in")
    p.add_argument("--window", type=int, default=5000, help="records (by id) per progressive-validation window")
    p.add_argument("--seed", type=int, default=7, help="the click stream's seed (for the oracle's scores)")
    p.add_argument("--drift-at", type=int, nargs="*", default=[], help="the stream's drift points (for the oracle)")
    p.add_argument("--batch-size", type=int, default=256, help="records per rank and step")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--prefetch", type=int, default=8,
                   help="batches read ahead by the reading thread (8 x 256 is about a shard: the next lease's round "
                        "trip is hidden behind the steps)")  # fmt: skip
    p.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                   help="score each record with the hidden model too (--no-oracle: the oracle columns stay 0)")
    p.add_argument("--ckpt-every", type=int, default=int(os.environ.get("STREAMROVER_CKPT_EVERY", "50")))
    p.add_argument("--live-from", type=int, default=0,
                   help="the first live record's id: freshness counts those from it (a backfilled history is old)")
    p.add_argument("--out", required=True, help="where rank 0 writes metrics.json and the final arrays")
    return p.parse_args(argv)


def write_metrics(out: Path, state: CtrState, step: int, started: float) -> dict[str, float]:
    """``metrics.json``: what the live view and the report read (atomically replaced); returns the newest figures."""
    rows = state.windows.numpy()
    figs = metrics.figures(rows, min_records=200)
    fresh = state.freshness.numpy()
    doc = {
        "updated": time.time(), "step": step, "started": started,
        "applied": int(state.ledger_sums[0]), "id_sum": int(state.ledger_sums[1]),
        "applied_span_ms": state.applied_span.tolist(),
        "fresh_p50_ms": metrics.quantile_ms(fresh, 0.5), "fresh_p99_ms": metrics.quantile_ms(fresh, 0.99),
        "windows": [vars(f) for f in figs],
    }  # fmt: skip
    tmp = out / f"metrics.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(doc))
    tmp.replace(out / "metrics.json")
    newest: dict[str, float] = {"records_in_model": float(doc["applied"]),
                                "freshness_p50_s": doc["fresh_p50_ms"] / 1000,
                                "freshness_p99_s": doc["fresh_p99_ms"] / 1000}  # fmt: skip
    full = [f for f in figs if f.records >= 1000]
    if full:
        newest.update(auc=full[-1].auc, oracle_auc=full[-1].oracle_auc, logloss=full[-1].logloss,
                      calibration=full[-1].calibration)  # fmt: skip
    return newest


def apply_step(state: CtrState, rows: np.ndarray, window: int, live_from: int = 0) -> None:
    """Apply one step's gathered records (``[n, _GATHERED]``) to the ledger, window rows and freshness (of the
    records from id ``live_from`` on: a backfilled history's event times are old)."""
    ids = rows[:, 0].astype(np.int64)
    if len(ids) == 0:
        return
    applied_ms = float(rows[:, 5].max())  # the step's update is in the model on every rank by then
    state.ledger.index_add_(0, torch.from_numpy(ids), torch.ones(len(ids), dtype=torch.int32))
    state.ledger_sums += torch.tensor([len(ids), int(ids.sum())], dtype=torch.int64)
    rows_of = np.clip(ids // window, 0, state.windows.shape[0] - 1)
    lo, hi = int(rows_of.min()), int(rows_of.max()) + 1  # a step's records fall in one or two windows: add only those
    state.windows[lo:hi] += torch.from_numpy(metrics.window_rows(rows_of - lo, rows[:, 1], rows[:, 2], rows[:, 3],
                                                                 rows[:, 4], applied_ms, hi - lo))  # fmt: skip
    state.freshness += torch.from_numpy(metrics.freshness_counts(rows[ids >= live_from, 4], applied_ms))
    if state.applied_span[0] == 0:
        state.applied_span[0] = applied_ms
    state.applied_span[1] = applied_ms


def serving(state: CtrState) -> tuple[TorchExporter | None, RowTracker | None]:
    """The exporter of the job spec's ``export:`` section (none without one): every durable checkpoint's DeepFM
    (``net.`` of the state) becomes an ONNX version, its 24 tables as touched-row deltas over bases (Adam moves
    every row it once saw: ``sticky``)."""
    config = ExportConfig.from_env()
    if config is None:
        return None, None
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")  # warnings and errors: stderr
    logging.getLogger("streamrover.serving").setLevel(logging.INFO)  # each version exported, in the worker's log
    tracker = RowTracker(state.net, sticky=True)
    example = (torch.zeros(1, len(CATEGORICAL), dtype=torch.int64), torch.zeros(1, len(NUMERIC)))
    exporter = TorchExporter(config, None, DeepFM, example, input_names=["cats", "nums"], output_names=["logit"],
                             select="net.", tables=tracker.params)  # fmt: skip
    return exporter, tracker


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    windows = (args.records + args.window - 1) // args.window
    state = CtrState(args.records, windows)
    ddp = DDP(state.net)
    optimizer = torch.optim.Adam(state.net.parameters(), lr=args.lr)
    exporter, tracker = serving(state)
    session = srt.attach(state, optimizer, ckpt_every=args.ckpt_every, exporter=exporter, tracker=tracker)
    oracle = ClickStream(args.seed, tuple(args.drift_at))
    dataset = session.dataset(args.dataset, batch_size=args.batch_size, idle_timeout=0.5, columns=COLUMNS,
                              prefetch=args.prefetch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, written = time.time(), 0.0
    print(f"rank {rank}/{world}: resumed at step {session.step} from {session.restored_from}; "
          f"{int(state.ledger_sums[0])} records in the model", flush=True)  # fmt: skip
    local = torch.empty(args.batch_size, _GATHERED, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(world)]
    done = int(state.ledger_sums[0]) >= args.records
    for batch in DataLoader(dataset, batch_size=None):
        if done:
            break
        cats, nums, y = features(batch)
        n = len(y)
        logits = ddp(cats, nums)  # scored before this step's update: progressive validation
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum") / max(n, 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        local.fill_(-1.0)  # rows past n: padding (id -1), dropped after the gather
        if n:
            local[:n, 0] = batch["id"].double()
            local[:n, 1] = logits.detach().double()
            local[:n, 2] = 0.0
            if args.oracle:
                local[:n, 2] = torch.from_numpy(oracle.oracle_logit({k: batch[k].numpy() for k in ORACLE_INPUT}))
            local[:n, 3] = y.double()
            local[:n, 4] = batch["event_ms"].double()
            local[:n, 5] = time.time() * 1000
        dist.all_gather(gathered, local)  # one collective per step besides DDP's
        rows = torch.cat(gathered).numpy()
        rows = rows[rows[:, 0] >= 0]
        apply_step(state, rows, args.window, args.live_from)
        step = session.step_done()
        if rank == 0 and time.time() - written >= 1.0:
            figures = write_metrics(out, state, step, started)
            try:  # the master's /metrics and dashboard show them (streamrover_trainer_metric)
                session.report(loss=loss.item(), **figures)
            except ShardServiceError as exc:  # the master may be restarting: the next report will do
                print(f"metrics not reported: {exc}", flush=True)
            written = time.time()
        done = int(state.ledger_sums[0]) >= args.records
    session.close()
    if rank == 0:
        write_metrics(out, state, session.step, started)
        np.save(out / "ledger.npy", state.ledger.numpy())
        np.save(out / "windows.npy", state.windows.numpy())
        np.save(out / "freshness.npy", state.freshness.numpy())
        np.save(out / "applied_span.npy", state.applied_span.numpy())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
