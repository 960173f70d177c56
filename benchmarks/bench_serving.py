"""Serving exports (streamrover.serving): what exporting costs the trainer, and delta bytes against full bytes.

Two measures, each with its peer in the same run:

1. **Export cost.** The flagship's DeepFM (examples/streaming_ctr/model.py, 12 fields, 24 tables of 4096 rows),
   batch 256, Adagrad, flash checkpoints persisted by the node's saver process (``saver="auto"``, as the demo's),
   trained without an exporter and with one (a RowTracker; every durable checkpoint exported to ONNX, tables as
   base + deltas, in the exporter's background thread). (a) At the demo's checkpoint rate: a step starts every
   ``--demo-step-ms`` (the demo's steps wait for the stream: 2 ranks x 256 records at 1,500 records/s is a step
   every 341 ms), a checkpoint every ``DemoConfig.ckpt_every`` steps. The two trainers run in one process and
   step in turn (which goes first alternates): they see the same machine at the same moments, so the drift that
   made two runs of one kind differ by up to ~9% (the design of earlier sessions: separate runs, then the
   median of pairs) cancels. Per trainer, a checkpoint interval's typical step: the median plain step and the
   median checkpointing step, weighted as they come; the training thread's CPU (the estimate: other processes
   cannot inflate it) and busy (wall) time, the ratio with/without, ``--reps`` times (3); the steps that
   overlapped an export are counted. Goal: at most 5% above the trainer without export. (b) A tight loop
   (~2 ms a step, a checkpoint every 20 steps: one every ~50 ms, persisted in-process), a worst case no stream
   produces, runs without and with export in turn. Adagrad, not the demo's Adam: touched-row deltas are exact
   only for optimizers that leave untouched rows alone (serving/tables.py). (c) The row tracker alone (its
   hooks, its stamps at each checkpoint), the training thread's CPU per step with and without it, alternating
   blocks. ``--parts 1`` runs part 1 only (``--parts 13``: parts 1 and 3).
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
from typing import Any

import numpy as np

from benchmarks._common import environment
from examples.streaming_ctr.demo import DemoConfig


class _Trainer:
    """Part 1's trainer: the flagship's DeepFM, Adagrad, flash checkpoints every ``every`` steps; with ``export``,
    a RowTracker and every durable checkpoint exported to ONNX (tables as base + deltas) in the background.
    Records each step's busy time (wall), the training thread's CPU time and its span."""

    def __init__(self, root: Path, export: bool, every: int, saver: str = "auto") -> None:
        import torch

        from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
        from examples.streaming_ctr.model import DeepFM
        from streamrover.ckpt import Checkpointer, RetentionPolicy
        from streamrover.ckpt.torch_adapter import TorchCheckpoint
        from streamrover.serving import ExportConfig, RowTracker, TorchExporter

        torch.manual_seed(0)
        self.every = every
        self.model = DeepFM()
        self.optimizer = torch.optim.Adagrad(self.model.parameters(), lr=0.05)
        self.tracker = RowTracker(self.model) if export else None
        example = (torch.zeros(1, len(CATEGORICAL), dtype=torch.int64), torch.zeros(1, len(NUMERIC)))
        self.exporter = TorchExporter(ExportConfig(str(root / "repo"), name="ctr", keep_last=3), str(root / "ckpt"),
                                      DeepFM, example, input_names=["cats", "nums"], output_names=["logit"],
                                      tables=self.tracker.params) if self.tracker else None  # fmt: skip
        #: (start, end) of each export (perf_counter): a step overlapping one may have waited for the GIL
        self.export_spans: list[tuple[float, float]] = []
        if self.exporter is not None:
            export_step = self.exporter.export_step

            def timed(step: int) -> bool:
                began = time.perf_counter()
                try:
                    return export_step(step)
                finally:
                    self.export_spans.append((began, time.perf_counter()))

            self.exporter.export_step = timed  # type: ignore[method-assign]
        self.checkpointer = Checkpointer(str(root / "ckpt"), saver=saver, retention=RetentionPolicy(keep_last=3),
                                         on_durable=self.exporter.on_durable if self.exporter else None)  # fmt: skip
        self.ckpt = TorchCheckpoint(self.checkpointer, self.model, self.optimizer)
        self.busy: list[float] = []
        self.cpu: list[float] = []
        self.spans: list[tuple[float, float]] = []

    def step(self, step: int, batch: tuple[Any, Any, Any]) -> None:
        import torch

        from streamrover.serving.tables import TOUCHED_KEY

        began, cpu = time.perf_counter(), time.thread_time()
        cats, nums, y = batch
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.model(cats, nums), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.tracker is not None:
            self.tracker.step_done(step)
        if step % self.every == 0:
            if self.exporter is not None:
                self.exporter.check()  # what a StreamSession does at each checkpoint
            extra = {TOUCHED_KEY: self.tracker.state()} if self.tracker is not None else None
            self.ckpt.save(step, extra=extra)
        ended = time.perf_counter()
        self.busy.append(ended - began)
        self.cpu.append(time.thread_time() - cpu)
        self.spans.append((began, ended))

    def close(self) -> tuple[int, float]:
        """Versions exported and the mean CPU seconds of one export (0 without export)."""
        self.checkpointer.close()
        if self.exporter is None:
            return 0, 0.0
        self.exporter.close()
        return len(self.exporter.exported), float(np.mean(self.exporter.cpu_seconds)) if self.exporter.seconds else 0.0


def _batches() -> list[tuple[Any, Any, Any]]:
    import torch

    from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC

    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 1 << 40, (256, len(CATEGORICAL)), generator=gen), torch.randn(256, len(NUMERIC),
             generator=gen), (torch.rand(256, generator=gen) < 0.2).float()) for _ in range(50)]  # fmt: skip


def _train(steps: int, export: bool, root: Path, every: int = 20) -> tuple[float, int, float, float]:
    """A tight loop of ``steps`` steps: mean step time (s), versions exported, CPU s per export, and the training
    thread's CPU time per step (what other processes on the machine cannot inflate)."""
    trainer, batches = _Trainer(root, export, every, saver="thread"), _batches()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.step(step, batches[step % len(batches)])
    elapsed = time.perf_counter() - started
    versions, each = trainer.close()
    return elapsed / steps, versions, each, float(np.mean(trainer.cpu))


def _paired(steps: int, period: float, every: int, root: Path) -> dict[str, float]:
    """Two trainers in one process, one without export and one with, stepped in turn (which goes first alternates)
    once every ``period`` s (the stream's pace): both see the same machine at the same moments, so drift between
    runs (~9% here) cancels. Returns the with/without ratios of the mean CPU time per step of the training thread
    (the estimate: a preempted step inflates wall time, not CPU time) and of the median busy (wall) time per step,
    the steps of each that overlapped an export (there the export's thread could hold the GIL), versions exported
    and CPU s per export."""
    without, with_export = _Trainer(root / "without", False, every), _Trainer(root / "with", True, every)
    batches = _batches()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        time.sleep(max(0.0, started + step * period - time.perf_counter()))  # the next batch's arrival
        for trainer in (without, with_export) if step % 2 else (with_export, without):
            trainer.step(step, batches[step % len(batches)])
    versions, each = with_export.close()
    without.close()

    def overlapping(trainer: _Trainer) -> int:
        return sum(any(a < end and begin < b for a, b in with_export.export_spans) for begin, end in trainer.spans)

    def typical(values: list[float]) -> float:
        """A checkpoint interval's typical time per step: the median plain step and the median checkpointing step,
        weighted as they come (medians: a step preempted by another process, or the first save's allocation, is
        not what export costs)."""
        plain = [v for i, v in enumerate(values, 1) if i % every]
        saving = [v for i, v in enumerate(values, 1) if not i % every]
        return float(((every - 1) * np.median(plain) + np.median(saving)) / every)

    return {"cpu": typical(with_export.cpu) / typical(without.cpu),
            "wall": typical(with_export.busy) / typical(without.busy),
            "cpu_mean": float(np.mean(with_export.cpu) / np.mean(without.cpu)),
            "wall_mean": float(np.mean(with_export.busy) / np.mean(without.busy)),
            "wall_without": typical(without.busy), "wall_with": typical(with_export.busy),
            "overlap_without": overlapping(without), "overlap_with": overlapping(with_export),
            "versions": versions, "per_export": each}  # fmt: skip


def _tracking_cost(blocks: int, steps: int = 50) -> tuple[float, float]:
    """The training thread's CPU per step (s, the best block: what contention leaves alone) without and with a
    RowTracker on the DeepFM:
    two models trained in alternating blocks of ``steps`` steps, the tracker's ``step_done`` every step and its
    ``state()`` (what a checkpoint takes) every ``DemoConfig.ckpt_every`` steps."""
    import torch

    from examples.streaming_ctr.model import DeepFM
    from streamrover.serving import RowTracker

    torch.manual_seed(0)
    models = [DeepFM(), DeepFM()]
    optimizers = [torch.optim.Adagrad(m.parameters(), lr=0.05) for m in models]
    tracker = RowTracker(models[1])
    every = DemoConfig().ckpt_every
    batches = _batches()
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
    p.add_argument("--reps", type=int, default=3, help="part 1: repetitions of (a) and pairs of (b)")
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
          f"checkpoint every {demo.ckpt_every} steps ({demo.ckpt_every * demo_step:.1f} s), {paced_steps} steps; two "
          "trainers in one process, without and with export, stepped in turn\n"
          "   (b) a tight loop (no wait between steps), a checkpoint every 20 steps: runs without and with export "
          "in turn")
    paired = []
    for rep in range(reps):
        with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
            r = _paired(paced_steps, demo_step, demo.ckpt_every, Path(tmp))
        paired.append(r)
        print(f"  (a) rep {rep + 1}: CPU per step with/without {r['cpu']:.3f} (means {r['cpu_mean']:.3f}), busy "
              f"{r['wall_with'] * 1e3:.2f} vs {r['wall_without'] * 1e3:.2f} ms/step: {r['wall']:.3f} (means "
              f"{r['wall_mean']:.3f}); {r['versions']} versions; steps overlapping an export: "
              f"{r['overlap_with']} with, {r['overlap_without']} without", flush=True)  # fmt: skip
    runs: dict[bool, list[float]] = {False: [], True: []}
    cpus: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for export in (False, True):
            with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
                step_s, _, _, cpu_s = _train(steps, export, Path(tmp))
            runs[export].append(step_s)
            cpus[export].append(cpu_s)
    for label, values in (("CPU", [r["cpu"] for r in paired]), ("busy (wall)", [r["wall"] for r in paired])):
        values.sort()
        print(f"1a. {label} per step, with export / without, at the demo's rate: median of {reps} reps "
              f"{statistics.median(values):.3f} (goal <= 1.05), range {values[0]:.3f}-{values[-1]:.3f}")
    ratios = sorted(w / b for b, w in zip(runs[False], runs[True], strict=True))
    cpu_ratios = sorted(w / b for b, w in zip(cpus[False], cpus[True], strict=True))
    print(f"1b. tight loop: median {statistics.median(runs[False]) * 1e3:.2f} ms/step without, "
          f"{statistics.median(runs[True]) * 1e3:.2f} with export; ratio of each pair: median "
          f"{statistics.median(ratios):.3f} (a worst case: a checkpoint every ~50 ms), range {ratios[0]:.3f}-"
          f"{ratios[-1]:.3f}; training thread's CPU: median {statistics.median(cpu_ratios):.3f}")  # fmt: skip
    plain, tracked = _tracking_cost(10 if quick else 40)
    print(f"1c. row tracking alone (RowTracker on the DeepFM's 24 tables, no checkpoint written), the training "
          f"thread's CPU per step, the best of alternating blocks: {plain * 1e3:.3f} ms without, "
          f"{tracked * 1e3:.3f} ms with: +{(tracked - plain) * 1e6:.0f} us, ratio {tracked / plain:.3f}")  # fmt: skip
    interval = demo.ckpt_every * demo_step
    per_export = statistics.median(r["per_export"] for r in paired)
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
