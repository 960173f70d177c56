"""Serving exports (streamrover.serving): what exporting costs the trainer, and delta bytes against full bytes.

Two measures, each with its peer in the same run:

1. **Export cost.** The flagship's DeepFM (examples/streaming_ctr/model.py, 12 tables of 4096 rows), batch 256,
   a flash checkpoint every 20 steps (the demo's rate, persisted by an in-process saver), trained for
   ``--steps`` steps without an exporter and with one (every durable checkpoint exported to ONNX, tables as
   base + deltas, in the exporter's background thread), alternated twice. Goal: the step time with export is
   at most 5% above the one without. Adagrad, not the demo's Adam: touched-row deltas are exact only for
   optimizers that leave untouched rows alone (serving/tables.py). This loop is a worst case: one process,
   ~2 ms a step, so a checkpoint every ~45 ms; the demo's steps (2 DDP ranks, Kafka reads, the ledger) take
   ~70 ms (``--demo-step-ms``, from ``python -m benchmarks ctr``), a checkpoint every ~1.4 s: the export's
   CPU time per version is also given as a share of that interval.
2. **Delta bytes.** One table of ``--rows`` x 16 float32; a delta file for touched shares from 0.1% to 100%
   against the full table's file (a base): bytes and the time to build each.
3. **Freshness from event to served** (benchmarks/_serving_fresh.py): a stream paced at ``--rate`` records/s
   (the demo's 2,500), the trainer checkpointing every ``--ckpt-every`` steps of 512 records, every durable
   checkpoint exported, KServe's model server (its own venv) polling the repository every 0.2 s, a client
   asking it every 20 ms: p50/p99 from a record's event time to the first answer of a version holding it,
   beside event time to applied in the trainer's model, in the same run. Goal: served p99 <= 5 s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import environment


def _train(steps: int, export: bool, root: Path, every: int = 20) -> tuple[float, int, float]:
    """Mean step time (s) over ``steps`` steps with checkpoints every ``every``; versions exported; export s each."""
    import torch

    from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
    from examples.streaming_ctr.model import DeepFM
    from streamrover.ckpt import Checkpointer, RetentionPolicy
    from streamrover.ckpt.torch_adapter import TorchCheckpoint
    from streamrover.serving import ExportConfig, RowTracker, TorchExporter
    from streamrover.serving.tables import TOUCHED_KEY

    torch.manual_seed(0)
    model = DeepFM()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    tracker = RowTracker(model) if export else None
    example = (torch.zeros(1, len(CATEGORICAL), dtype=torch.int64), torch.zeros(1, len(NUMERIC)))
    exporter = TorchExporter(ExportConfig(str(root / "repo"), name="ctr", keep_last=3), str(root / "ckpt"), DeepFM,
                             example, input_names=["cats", "nums"], output_names=["logit"],
                             tables=tracker.params if tracker else None) if export else None  # fmt: skip
    checkpointer = Checkpointer(str(root / "ckpt"), saver="thread", retention=RetentionPolicy(keep_last=3),
                                on_durable=exporter.on_durable if exporter else None)  # fmt: skip
    ckpt = TorchCheckpoint(checkpointer, model, optimizer)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 1 << 40, (256, len(CATEGORICAL)), generator=gen), torch.randn(256, len(NUMERIC),
                generator=gen), (torch.rand(256, generator=gen) < 0.2).float()) for _ in range(50)]  # fmt: skip
    started = time.perf_counter()
    for step in range(1, steps + 1):
        cats, nums, y = batches[step % len(batches)]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(cats, nums), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if tracker is not None:
            tracker.step_done(step)
        if step % every == 0:
            extra = {TOUCHED_KEY: tracker.state()} if tracker is not None else None
            ckpt.save(step, extra=extra)
    elapsed = time.perf_counter() - started
    checkpointer.close()
    if exporter is None:
        return elapsed / steps, 0, 0.0
    exporter.close()
    return elapsed / steps, len(exporter.exported), float(np.mean(exporter.cpu_seconds)) if exporter.seconds else 0.0


def _delta_bytes(rows: int, shares: list[float]) -> list[tuple[float, int, int, float, float]]:
    from streamrover.serving.tables import delta_arrays, dump_arrays

    rng = np.random.default_rng(0)
    table = rng.standard_normal((rows, 16), dtype=np.float32)
    t0 = time.perf_counter()
    full = len(dump_arrays({"t": table}))
    full_s = time.perf_counter() - t0
    out = []
    for share in shares:
        stamps = np.zeros(rows, dtype=np.int64)
        stamps[rng.choice(rows, int(rows * share), replace=False)] = 2
        t0 = time.perf_counter()
        delta = len(dump_arrays(delta_arrays({"t": table}, {"t": stamps}, 1)))
        out.append((share, delta, full, time.perf_counter() - t0, full_s))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke-sized run")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--rate", type=float, default=2500.0, help="part 3: records/s of the paced stream (the demo's)")
    p.add_argument("--seconds", type=float, default=40.0, help="part 3: how long the stream runs")
    p.add_argument("--ckpt-every", type=int, nargs="+", default=[20, 5], help="part 3: steps between checkpoints")
    p.add_argument("--demo-step-ms", type=float, default=73.0,
                   help="the demo's step time (2 ranks x 256 records at ~7,000 records/s: python -m benchmarks ctr)")
    args, _ = p.parse_known_args(argv)
    steps = 100 if args.quick else args.steps
    rows = 1 << 16 if args.quick else args.rows
    print(environment())
    import torch

    torch.set_num_threads(1)
    runs: dict[bool, list[float]] = {False: [], True: []}
    versions, per_export = 0, 0.0
    for rep in range(2):
        for export in (False, True):
            with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
                step_s, n, each = _train(steps, export, Path(tmp))
            runs[export].append(step_s)
            if export:
                versions, per_export = versions + n, each
            print(f"  run {rep + 1} {'with export   ' if export else 'without export'}: {step_s * 1e3:.2f} ms/step"
                  + (f", {n} versions" if export else ""), flush=True)  # fmt: skip
    base, with_export = min(runs[False]), min(runs[True])
    print(f"\n1. export cost: {base * 1e3:.2f} ms/step without, {with_export * 1e3:.2f} ms/step with export "
          f"(checkpoint every 20 steps, {versions} versions): ratio {with_export / base:.3f} "
          f"(goal <= 1.05)")  # fmt: skip
    interval = 20 * args.demo_step_ms / 1000
    print(f"   one export (checkpoint read, ONNX, tables, publish) used {per_export:.3f} CPU s: "
          f"{per_export / interval:.1%} of the demo's checkpoint interval ({interval:.2f} s; goal <= 5%)")
    print(f"\n2. delta bytes vs full, one table of {rows} x 16 float32:")
    print(f"   {'touched':>8} {'delta B':>12} {'full B':>12} {'ratio':>7} {'delta s':>8} {'full s':>7}")
    for share, delta, full, delta_s, full_s in _delta_bytes(rows, [0.001, 0.01, 0.1, 0.5, 1.0]):
        print(f"   {share:8.1%} {delta:12d} {full:12d} {delta / full:7.3f} {delta_s:8.3f} {full_s:7.3f}")
    from benchmarks._serving_fresh import measure

    seconds = 12.0 if args.quick else args.seconds
    print(f"\n3. freshness at {args.rate:.0f} records/s, batches of 512, {seconds:.0f} s per run:")
    for every in args.ckpt_every:
        r = measure(args.rate, seconds, every)
        print(f"   checkpoint every {every:3d} steps ({every * 512 / args.rate:.1f} s): event->served p50 "
              f"{r['served_p50']:.2f} s p99 {r['served_p99']:.2f} s (goal <= 5 s); event->applied p50 "
              f"{r['applied_p50']:.2f} s p99 {r['applied_p99']:.2f} s; served/applied p99 "
              f"{r['served_p99'] / max(r['applied_p99'], 1e-9):.1f}x; {r['versions_seen']} of {r['checkpoints']} "
              "versions answered", flush=True)  # fmt: skip
        print("     medians: " + ", ".join(f"{k} {v:.3f} s" for k, v in r["stages"].items()), flush=True)
    return 0
