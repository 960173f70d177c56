"""`make demo`: a batch backfill through the shard service, with a worker killed midway.

It writes a few parquet files, starts a job master, registers the files as a
dataset, runs two worker processes that consume shards into a durable ledger
(the stand-in for a model), SIGKILLs one worker halfway, lets the other finish
(the dead worker's shards come back when its lease expires), and ends with a
report: every row applied exactly once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, start_ledger_worker


def write_files(root: Path, rows: int, files: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    ids = rng.permutation(rows).astype(np.int64)
    root.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(ids, files)):
        table = pa.table(
            {
                "id": part,
                "user": rng.integers(0, 10_000, part.size),
                "ad": rng.integers(0, 500, part.size),
                "clicked": (rng.random(part.size) < 0.03).astype(np.int8),
            }
        )
        pq.write_table(table, root / f"impressions-{i:02d}.parquet", row_group_size=25_000)
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="streamrover batch backfill demo")
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    console = Console()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="streamrover-demo-"))
    console.rule("[bold]streamrover demo: batch backfill, exactly once")
    ids = write_files(work / "data", args.rows, args.files)
    console.print(f"wrote {args.rows:,} rows in {args.files} parquet files under {work / 'data'}")

    ledger_path = work / "ledger.db"
    Ledger(ledger_path).close()
    with MasterProcess(work / "master", lease_ttl=2.0) as master:
        console.print(f"master listening on {master.address} (journal {work / 'master' / 'journal.db'})")
        admin = ShardClient(master.address, token=master.token, heartbeat=False)
        info = admin.register_dataset(DatasetSpec("impressions", str(work / "data"), records_per_shard=10_000)).dataset
        console.print(f"dataset 'impressions': {len(info.partitions)} partitions, {info.shards.todo} shards")
        workers = {
            name: start_ledger_worker(master, "impressions", ledger_path, name=name, batch_size=1_000)
            for name in ("worker-a", "worker-b")
        }
        killed, killed_at = "", 0
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("rows acked", total=args.rows, rate="")
            while True:
                st = admin.status()
                ds = st.datasets[0]
                progress.update(task, completed=ds.records_acked, rate=f"{st.records_per_second:,.0f} rows/s")
                if not killed and ds.records_acked >= args.rows // 2 and not ds.finished:
                    killed, killed_at = "worker-a", ds.records_acked
                    workers[killed].send_signal(signal.SIGKILL)
                    progress.console.print(
                        f"[red]SIGKILL {killed}[/red] at {ds.records_acked:,} rows acked; "
                        "its shards return when its lease expires"
                    )
                if ds.finished:
                    break
                # The refresh rate of the display; until the kill, fast enough to kill near the middle
                # (the workers read a few hundred thousand rows a second).
                time.sleep(0.1 if killed else 0.002)
        for proc in workers.values():
            proc.wait()
        cut_id, _ = admin.prepare_cut()
        admin.commit_cut(cut_id)
        final = admin.describe_dataset("impressions")
        admin.close()

    report = Ledger(ledger_path).verify(ids)
    table = Table(title="exactly-once report")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("rows produced", f"{report.expected:,}")
    table.add_row("rows applied to the ledger", f"{report.applied:,}")
    table.add_row("duplicates", str(report.duplicates))
    table.add_row("missing", str(report.missing))
    table.add_row("sum of ids", "matches" if report.id_sum_ok else "DIFFERS")
    table.add_row("worker killed", f"{killed} at {killed_at:,} rows acked" if killed else "none")
    table.add_row("rows in the committed cursor", f"{final.records_committed:,} (cut {cut_id})")
    console.print(table)
    # The kill must have landed mid-run (rows still to read), or the demo proved nothing about recovery.
    ok = report.exact and final.records_committed == args.rows and bool(killed) and killed_at < args.rows
    console.print("[bold green]every row applied exactly once[/bold green]" if ok else f"[bold red]{report}[/bold red]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
