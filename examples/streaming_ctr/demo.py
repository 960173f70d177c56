"""`make demo`: online CTR training from a live Kafka topic, exactly once, with a worker SIGKILLed midway.

``python -m examples.streaming_ctr.demo`` starts, on embedded defaults:

1. the tansu broker (Kafka protocol; ``--bootstrap`` uses any other cluster instead);
2. the producer (produce.py) writing the click stream at ``--rate`` records/s, with one concept
   drift at ``--drift-at``;
3. ``streamrover run`` of a copy of job.yaml (this broker, these sizes): the controller starts
   the job master, registers the ``clicks`` dataset and launches one ``dlrover-run`` node with
   two DDP workers running train.py;
4. a live view (rich) of lag, records/s, AUC against the oracle, freshness and restarts;
5. a SIGKILL of one worker once ``--kill-at`` of the records are acked (dlrover-run restarts the
   group, rank 0 restores the newest checkpoint, the shard service hands out again what it held);
6. the report: ledger exact, AUC/oracle before and after the drift, freshness p50/p99, throughput,
   PNG plots and ``report.html`` under the work directory;
7. with ``serve`` (the default; served.py): every durable checkpoint exported, KServe's model server
   loading each version, live records sent to it: the served model's AUC and event-to-served freshness.

Exit status 0 when every record was applied exactly once and the kill happened mid-run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python examples/streaming_ctr/demo.py` works too
    sys.path.insert(0, str(ROOT))

from examples.streaming_ctr import first_act, report, served  # noqa: E402
from examples.streaming_ctr.clickstream import SCHEMA  # noqa: E402
from examples.streaming_ctr.live import Watcher, render  # noqa: E402
from examples.streaming_ctr.produce import ensure_topic  # noqa: E402
from streamrover.operator.jobs import JobDir  # noqa: E402
from streamrover.testing.procs import python_env  # noqa: E402

HERE = Path(__file__).resolve().parent


@dataclass
class DemoConfig:
    records: int = 150_000
    rate: float = 1_500.0
    drift_at: int = 75_000
    window: int = 5_000
    kill_at: float | None = 0.35  # None: no SIGKILL
    oracle: bool = True
    produce: bool = True  # False: the topic already holds the records (a benchmark's prefilled topic)
    # One partition per worker: the master leases a worker the next shard of the partition it reads, and
    # DDP steps the ranks in lock-step, so the partitions stay level in event time. More partitions than
    # workers, with a backlog, let some partitions run ahead of others by tens of thousands of records.
    partitions: int = 2
    batch_size: int = 256
    ckpt_every: int = 5  # ~1.7 s at --rate 1500 (512 records a step): event to served p99 <= 5 s
    seed: int = 7
    workdir: Path | None = None
    bootstrap: str | None = None
    topic: str = ""
    timeout: float = 900.0
    history: int = 0  # the first act: the first records, trained from their Parquet export, then live (first_act.py)
    serve: bool = True  # export versions, start the model server, send it the live records (served.py)


def render_spec(cfg: DemoConfig, uri: str, out: Path) -> dict[str, Any]:
    """job.yaml with this run's broker, sizes and output directory."""
    spec = yaml.safe_load((HERE / "job.yaml").read_text())
    spec["datasets"][0]["uri"] = uri
    assert spec["datasets"][0]["options"]["sr.schema"] == SCHEMA, "job.yaml's sr.schema differs from clickstream.py"
    spec["trainer"]["script"] = str(HERE / "train.py")
    spec["trainer"]["args"] = ["--records", str(cfg.records), "--window", str(cfg.window), "--seed", str(cfg.seed),
                               "--drift-at", str(cfg.drift_at), "--batch-size", str(cfg.batch_size),
                               "--out", str(out), "--oracle" if cfg.oracle else "--no-oracle"]  # fmt: skip
    spec["checkpoint"]["every_steps"] = cfg.ckpt_every
    if cfg.serve:
        spec["export"] = served.export_section(out.parent / "models")
    return spec


def _start_broker(work: Path) -> Any:
    from tests.brokers.tansu import TansuBroker

    broker = TansuBroker(work / "tansu")
    broker.start()
    return broker


def run_demo(cfg: DemoConfig, console: Console, live: bool = True) -> tuple[report.Summary, Path]:
    """Run the demo (see the module docstring); returns the report's figures and the work directory."""
    work = Path(cfg.workdir or tempfile.mkdtemp(prefix="streamrover-ctr-"))
    work.mkdir(parents=True, exist_ok=True)
    out, home = work / "out", work / "home"
    out.mkdir(exist_ok=True)
    broker = _start_broker(work) if cfg.bootstrap is None else None
    bootstrap = cfg.bootstrap or broker.bootstrap
    topic = cfg.topic or f"clicks-{uuid.uuid4().hex[:6]}"
    procs: list[subprocess.Popen[bytes]] = []
    probe: served.ServedProbe | None = None
    try:
        ensure_topic(bootstrap, topic, cfg.partitions)
        console.print(f"broker {bootstrap} ({'tansu, embedded' if broker else 'given'}), topic {topic!r}, "
                      f"work directory {work}")  # fmt: skip
        seam = None
        if cfg.history:  # the first act: the topic's past exported to Parquet, trained first (first_act.py)
            seam = first_act.prepare(bootstrap, topic, cfg.partitions, cfg.history, cfg.seed, cfg.drift_at,
                                     work / "lake")  # fmt: skip
            console.print(f"first act: {cfg.history:,} records exported to {seam.lake} ({seam.files} Parquet files)")
        if cfg.serve:  # after the first act: the client sends the server the live records only
            probe = served.ServedProbe(work, bootstrap, topic, cfg.partitions, work / "models",
                                       start=seam.boundary if seam is not None else None)  # fmt: skip
            probe.start()
        spec = render_spec(cfg, f"kafka://{bootstrap}/{topic}", out)
        if seam is not None:
            first_act.configure(spec, seam)
        spec_path = work / "job.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        env = {**python_env(), "STREAMROVER_HOME": str(home)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        progress = work / "producer.json"
        producer_cmd = [sys.executable, "-m", "examples.streaming_ctr.produce", "--bootstrap", bootstrap, "--topic",
                        topic, "--records", str(cfg.records), "--rate", str(cfg.rate), "--seed", str(cfg.seed),
                        "--drift-at", str(cfg.drift_at), "--progress", str(progress),
                        "--partitions", str(cfg.partitions), "--start", str(cfg.history)]  # fmt: skip

        def start_producer() -> subprocess.Popen[bytes]:
            with open(work / "producer.log", "ab") as log:
                procs.append(subprocess.Popen(producer_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
            return procs[-1]

        run_cmd = [sys.executable, "-m", "streamrover.cli", "run", str(spec_path)]
        console.print(f"$ streamrover run {spec_path}   (from {HERE / 'job.yaml'})")
        with open(work / "run.log", "ab") as log:
            controller = subprocess.Popen(run_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        procs.append(controller)
        watcher = Watcher(JobDir(home / "jobs" / spec["name"]), out, progress, per_node=spec["restart"]["per_node"])
        killed = _watch(cfg, console, watcher, controller, start_producer, live, probe)
        if probe is not None:
            probe.finish(cfg.records)
        watcher.close()
        watcher.dump(work / "samples.json")
        if controller.returncode != 0:
            raise RuntimeError(f"streamrover run exited {controller.returncode}; see {work / 'run.log'} and "
                               f"{home / 'jobs' / spec['name'] / 'logs'}")  # fmt: skip
        samples = [vars(s) for s in watcher.samples]
        summary = report.summarize(out, cfg.records, cfg.drift_at, cfg.window, samples, killed)
        import numpy as np

        images = report.plots(out, np.load(out / "windows.npy"), np.load(out / "freshness.npy"), samples,
                              cfg.drift_at, cfg.window)  # fmt: skip
        if seam is not None:
            summary.seam = seam.describe(np.load(out / "ledger.npy"), samples)
        if probe is not None:
            summary.served = probe.summarize(out, cfg.window, np.load(out / "windows.npy"))
            summary.served.diagnosis = probe.diagnosis(home / "jobs" / spec["name"] / "logs")
            images += served.plots(out, probe, np.load(out / "windows.npy"), cfg.window, cfg.drift_at,
                                   np.load(out / "freshness.npy"))  # fmt: skip
        report.write_html(out, summary, images)
        return summary, work
    finally:
        if probe is not None:
            probe.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the controller stops its nodes and the master
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if broker is not None:
            broker.stop()


def _watch(cfg: DemoConfig, console: Console, watcher: Watcher, controller: subprocess.Popen[bytes],
           start_producer: Callable[[], subprocess.Popen[bytes]], live: bool,
           probe: served.ServedProbe | None = None) -> str:
    """Sample and show the run until the controller exits; returns what was killed.

    The producer starts once both ranks joined the shard service (the stream is live: freshness
    measures training, not the job's start-up); a worker is SIGKILLed once ``kill_at`` of the records are acked.
    """
    killed, note = "", ""
    producer: subprocess.Popen[bytes] | None = None
    deadline = time.monotonic() + cfg.timeout
    with Live(render(watcher.sample(), cfg.records), console=console, refresh_per_second=4,
              transient=False, auto_refresh=False) as view:  # fmt: skip
        while controller.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish within {cfg.timeout:.0f} s")
            s = watcher.sample()
            if producer is None and s.joined >= 2 and cfg.produce and s.acked >= cfg.history:  # (after the past)
                producer = start_producer()
                after = f"the past ({cfg.history:,} records) acked" if cfg.history else "both ranks joined"
                console.print(f"{after} at {s.t:.0f} s: the producer starts ({cfg.rate:,.0f} records/s)")
            if producer is not None and producer.poll() not in (None, 0):
                raise RuntimeError(f"the producer exited {producer.returncode}")
            if cfg.kill_at is not None and not killed and s.acked >= cfg.kill_at * cfg.records and s.workers >= 2:
                doc = watcher.job.status()
                pids = {rank: pid for n in doc["nodes"] for rank, pid in n.get("workers", {}).items()}
                rank = sorted(pids)[-1]
                os.kill(pids[rank], signal.SIGKILL)
                killed = f"worker rank {rank} (pid {pids[rank]}) at {s.acked:,} records acked"
                note = f"SIGKILL {killed}"
                console.print(f"[red]{note}[/red]")
            if probe is not None:
                probe.report(watcher.client)
            if live:
                view.update(render(s, cfg.records, note, probe.line() if probe else ""), refresh=True)
            time.sleep(0.5)  # the view's refresh period
        view.update(render(watcher.sample(), cfg.records, note), refresh=True)
    if cfg.kill_at is not None and not killed:
        raise RuntimeError("the job finished before the worker could be killed: nothing was recovered")
    return killed


def main(argv: list[str] | None = None) -> int:
    d = DemoConfig()
    p = argparse.ArgumentParser(description="streamrover demo: online CTR from Kafka, exactly once")
    p.add_argument("--records", type=int, default=d.records)
    p.add_argument("--rate", type=float, default=d.rate, help="records/s the producer writes")
    p.add_argument("--drift-at", type=int, default=d.drift_at)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--kill-at", type=float, default=d.kill_at, help="fraction of records acked at the SIGKILL")
    p.add_argument("--bootstrap", default=None, help="a Kafka cluster to use instead of the embedded tansu")
    p.add_argument("--history", type=int, default=20_000,
                   help="the first act: records trained from the topic's Parquet export before going live (0: none)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="no exports, no model server (the served part of the report is left out)")
    args = p.parse_args(argv)
    cfg = DemoConfig(records=args.records, rate=args.rate, drift_at=args.drift_at, window=args.window,
                     kill_at=args.kill_at, bootstrap=args.bootstrap, history=args.history, serve=args.serve,
                     workdir=Path(args.workdir) if args.workdir else None)  # fmt: skip
    console = Console() if sys.stdout.isatty() else Console(width=120)  # a log keeps its columns
    console.rule("[bold]streamrover demo: online CTR from Kafka, exactly once")
    started = time.monotonic()
    summary, work = run_demo(cfg, console, live=console.is_terminal)
    table = Table(title=f"report ({time.monotonic() - started:.0f} s)")
    table.add_column("check")
    table.add_column("value", justify="right")
    for k, v in report.describe(summary):
        table.add_row(k, v)
    console.print(table)
    console.print(f"plots and report: {work / 'out' / 'report.html'}")
    ok = summary.exact and bool(summary.killed)
    console.print("[bold green]every record applied exactly once[/bold green]" if ok else "[bold red]FAILED[/bold red]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
