"""Serving exports (streamrover.serving): what exporting costs the trainer, and delta bytes against full bytes.

Two measures, each with its peer in the same run:

1. **Export cost.** The flagship's DeepFM (examples/streaming_ctr/model.py, 12 tables of 4096 rows), batch 256,
   flash checkpoints persisted by an in-process saver, trained without an exporter and with one (every durable
   checkpoint exported to ONNX, tables as base + deltas, in the exporter's background thread), alternated
   ``--reps`` times (4); the estimate is the median of each rep's with/without ratio (two runs of one kind differ
   by up to ~9% here: the best of two, once used, could not tell 5% apart). (a) At the demo's checkpoint rate:
   a step starts every ``--demo-step-ms`` (the demo's steps wait for the stream: 2 ranks x 256 records at 1,500
   records/s is a step every 341 ms), a checkpoint every
   ``DemoConfig.ckpt_every`` steps; the step time is each step's busy time. Goal: at most 5% above the run
   without export. (b) A tight loop (~2 ms a step, a checkpoint every 20 steps: one every ~50 ms), a worst
   case no stream produces. Adagrad, not the demo's Adam: touched-row deltas are exact only for
   optimizers that leave untouched rows alone (serving/tables.py). (c) The row tracker alone (its hooks, its
   stamps at each checkpoint), the training thread's CPU per step with and without it, alternating blocks.
   ``--parts 1`` runs part 1 only (``--parts 13``: parts 1 and 3).
2. **Delta bytes.** One table of ``--rows`` x 16 float32; a delta file for touched shares from 0.1% to 100%
   against the full table's file (a base): bytes and the time to build each.
3. **Freshness from event to served** (benchmarks/_serving_fresh.py): a stream paced at ``--rate`` records/s
   (make demo's 1,500), the trainer checkpointing every ``--ckpt-every`` steps of 512 records (the demo's 5,
   and 20), every durable checkpoint exported, KServe's model server (its own venv) polling the repository
   every 0.1 s, a client
   asking it every 20 ms: p50/p99 from a record's event time to the first answer of a version holding it,
   beside event time to applied in the trainer's model, in the same run. Goal: served p99 <= 5 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import environment
from examples.streaming_ctr.demo import DemoConfig


def _train(steps: int, export: bool, root: Path, every: int = 20, period: float = 0.0
           ) -> tuple[float, int, float, float]:
    """Mean step time (s) over ``steps`` steps with checkpoints every ``every``; versions exported; export s each.

    ``period`` > 0: a step starts every ``period`` s (the stream's pace: the demo's steps wait for records), and
    the step time is the busy time of each step (forward, backward, update, checkpoint call), not the wait.
    Also returns the training thread's CPU time per step (what other processes on the machine cannot inflate)."""
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
    started, busy, cpu = time.perf_counter(), 0.0, time.thread_time()
    for step in range(1, steps + 1):
        if period:
            time.sleep(max(0.0, started + step * period - time.perf_counter()))  # the next batch's arrival
        begun = time.perf_counter()
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
        busy += time.perf_counter() - begun
    elapsed = busy if period else time.perf_counter() - started
    cpu = time.thread_time() - cpu
    checkpointer.close()
    if exporter is None:
        return elapsed / steps, 0, 0.0, cpu / steps
    exporter.close()
    each = float(np.mean(exporter.cpu_seconds)) if exporter.seconds else 0.0
    return elapsed / steps, len(exporter.exported), each, cpu / steps


def _tracking_cost(blocks: int, steps: int = 50) -> tuple[float, float]:
    """The training thread's CPU per step (s, the best block: what contention leaves alone) without and with a
    RowTracker on the DeepFM:
    two models trained in alternating blocks of ``steps`` steps, the tracker's ``step_done`` every step and its
    ``state()`` (what a checkpoint takes) every ``DemoConfig.ckpt_every`` steps."""
    import torch

    from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
    from examples.streaming_ctr.model import DeepFM
    from streamrover.serving import RowTracker

    torch.manual_seed(0)
    models = [DeepFM(), DeepFM()]
    optimizers = [torch.optim.Adagrad(m.parameters(), lr=0.05) for m in models]
    tracker = RowTracker(models[1])
    every = DemoConfig().ckpt_every
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 1 << 40, (256, len(CATEGORICAL)), generator=gen), torch.randn(256, len(NUMERIC),
                generator=gen), (torch.rand(256, generator=gen) < 0.2).float()) for _ in range(50)]  # fmt: skip
    cpu: list[list[float]] = [[], []]
    step = 0
    for _ in range(blocks):
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            began = time.thread_time()
            for _ in range(steps):
                step += 1
                cats, nums, y = batches[step % len(batches)]
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(cats, nums), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if i:
                    tracker.step_done(step)
                    if step % every == 0:
                        tracker.state()
            cpu[i].append((time.thread_time() - began) / steps)
    return float(np.min(cpu[0])), float(np.min(cpu[1]))


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
    p.add_argument("--rate", type=float, default=DemoConfig().rate, help="part 3: records/s (make demo's)")
    p.add_argument("--seconds", type=float, default=40.0, help="part 3: how long the stream runs")
    p.add_argument("--ckpt-every", type=int, nargs="+", default=[DemoConfig().ckpt_every, 20],
                   help="part 3: steps between checkpoints (the demo's first)")
    p.add_argument("--demo-step-ms", type=float, default=1000 * 2 * DemoConfig().batch_size / DemoConfig().rate,
                   help="the demo's step period: 2 ranks x 256 records at make demo's 1,500 records/s")
    p.add_argument("--parts", default="123",
                   help="which parts to run (digits: 1 export cost, 2 delta bytes, 3 freshness)")
    p.add_argument("--reps", type=int, default=4,
                   help="part 1: alternating runs without and with export (two runs of one kind differ by ~9%%)")
    args, _ = p.parse_known_args(argv)
    steps = 100 if args.quick else args.steps
    rows = 1 << 16 if args.quick else args.rows
    print(environment())
    import torch

    torch.set_num_threads(1)
    demo = DemoConfig()
    demo_step = args.demo_step_ms / 1000
    if "1" in args.parts:
        _part1(demo, demo_step, steps, args.quick, 2 if args.quick else args.reps)
    if "2" in args.parts:
        _part2(rows)
    if "3" in args.parts:
        _part3(args)
    return 0


def _part1(demo: DemoConfig, demo_step: float, steps: int, quick: bool, reps: int) -> None:
    paced_steps = max(40, int((20.0 if quick else 60.0) / demo_step))
    print(f"1. export cost: the flagship's DeepFM, batch 256, Adagrad, every checkpoint exported in the background\n"
          f"   (a) at the demo's checkpoint rate: a step every {demo_step * 1e3:.0f} ms (the stream's pace), a "
          f"checkpoint every {demo.ckpt_every} steps ({demo.ckpt_every * demo_step:.1f} s), {paced_steps} steps; "
          "busy time per step\n   (b) a tight loop (no wait between steps), a checkpoint every 20 steps")
    results = {}
    for label, every, period, n in (("a", demo.ckpt_every, demo_step, paced_steps), ("b", 20, 0.0, steps)):
        runs: dict[bool, list[float]] = {False: [], True: []}
        cpus: dict[bool, list[float]] = {False: [], True: []}
        versions, per_export = 0, 0.0
        for rep in range(reps):
            for export in (False, True):
                with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
                    step_s, v, each, cpu_s = _train(n, export, Path(tmp), every, period)
                runs[export].append(step_s)
                cpus[export].append(cpu_s)
                if export:
                    versions, per_export = versions + v, each
                print(f"  ({label}) run {rep + 1} {'with export   ' if export else 'without export'}: "
                      f"{step_s * 1e3:.2f} ms/step ({cpu_s * 1e3:.2f} CPU ms)"
                      + (f", {v} versions" if export else ""), flush=True)  # fmt: skip
        # each rep's pair ran back to back: its ratio is the least disturbed by drift on the machine; the median
        # of the pairs' ratios is the estimate, their range the noise it stands in
        ratios = sorted(w / b for b, w in zip(runs[False], runs[True], strict=True))
        cpu_ratios = sorted(w / b for b, w in zip(cpus[False], cpus[True], strict=True))
        results[label] = (statistics.median(runs[False]), statistics.median(runs[True]), versions, per_export,
                          ratios, cpu_ratios)  # fmt: skip
    for label, (base, with_export, versions, _each, ratios, cpu_ratios) in results.items():
        goal = " (goal <= 1.05)" if label == "a" else " (a worst case: a checkpoint every ~50 ms)"
        print(f"1{label}. median {base * 1e3:.2f} ms/step without, {with_export * 1e3:.2f} ms/step with export "
              f"({versions} versions); ratio of each rep's pair: median {statistics.median(ratios):.3f}{goal}, "
              f"range {ratios[0]:.3f}-{ratios[-1]:.3f}; the training thread's CPU per step, the same: median "
              f"{statistics.median(cpu_ratios):.3f}, range {cpu_ratios[0]:.3f}-{cpu_ratios[-1]:.3f}")  # fmt: skip
    plain, tracked = _tracking_cost(10 if quick else 40)
    print(f"1c. row tracking alone (RowTracker on the DeepFM's 24 tables, no checkpoint written), the training "
          f"thread's CPU per step, the best of alternating blocks: {plain * 1e3:.3f} ms without, "
          f"{tracked * 1e3:.3f} ms with: +{(tracked - plain) * 1e6:.0f} us, ratio {tracked / plain:.3f}")  # fmt: skip
    interval = demo.ckpt_every * demo_step
    per_export = results["a"][3]
    print(f"   one export (checkpoint read, ONNX, tables, publish) used {per_export:.3f} CPU s: "
          f"{per_export / interval:.1%} of the demo's checkpoint interval ({interval:.2f} s), in the exporter's thread")


def _part2(rows: int) -> None:
    print(f"\n2. delta bytes vs full, one table of {rows} x 16 float32:")
    print(f"   {'touched':>8} {'delta B':>12} {'full B':>12} {'ratio':>7} {'delta s':>8} {'full s':>7}")
    for share, delta, full, delta_s, full_s in _delta_bytes(rows, [0.001, 0.01, 0.1, 0.5, 1.0]):
        print(f"   {share:8.1%} {delta:12d} {full:12d} {delta / full:7.3f} {delta_s:8.3f} {full_s:7.3f}")


def _part3(args: argparse.Namespace) -> None:
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
