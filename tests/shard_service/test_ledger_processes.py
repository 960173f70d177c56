"""Real processes, real kills: one master and worker processes consume parquet into a durable ledger.

Workers are SIGKILLed and the master is SIGKILLed and restarted at random moments
(chosen by progress, so they land mid-run whatever the machine's speed); a cut is
taken and committed repeatedly meanwhile. At the end the ledger must hold every
produced id exactly once, no live worker may ever have had its ledger write
refused (that would mean two live leases on one shard), and the master's
committed cursor must cover every row.
"""

from __future__ import annotations

import random
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from streamrover.cursor import IntervalSet
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, start_ledger_worker
from tests.helpers import wait_until, write_parquet_dataset

ROWS = 1_000_000


def _worker(master: MasterProcess, ledger: Path, name: str, batch_size: int) -> subprocess.Popen[bytes]:
    return start_ledger_worker(master, "rows", ledger, name=name, batch_size=batch_size)


def _applied(ledger: Path) -> int:
    led = Ledger(ledger)
    try:
        return int(led._db.execute("SELECT COALESCE(SUM(count), 0) FROM chunks").fetchone()[0])
    finally:
        led.close()


@pytest.mark.slow
def test_million_rows_exact_under_worker_and_master_kills(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}")
    ids = write_parquet_dataset(tmp_path / "data", ROWS, files=6, row_group_size=50_000, seed=seed)
    ledger_path = tmp_path / "ledger.db"
    Ledger(ledger_path).close()
    master = MasterProcess(tmp_path / "master", lease_ttl=2.0)
    master.start()
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=60)
    try:
        admin.register_dataset(DatasetSpec("rows", str(tmp_path / "data" / "*.parquet"), records_per_shard=20_000))
        workers = {f"w{i}": _worker(master, ledger_path, f"w{i}", 2_000) for i in range(3)}

        # Random moments, as fractions of the rows applied: two worker kills and one master kill.
        moments = sorted(rng.uniform(0.1, 0.85) for _ in range(3))
        kinds = ["worker", "worker", "master"]
        rng.shuffle(kinds)
        cuts = {"prepared": 0, "committed": 0}
        stop_cuts = threading.Event()

        def take_cuts() -> None:  # checkpoints keep being taken while processes die
            client = ShardClient(master.address, token=master.token, heartbeat=False, timeout=60)
            while not stop_cuts.wait(0.3):
                cut_id, _ = client.prepare_cut()
                cuts["prepared"] += 1
                client.commit_cut(cut_id)
                cuts["committed"] += 1
            client.close()

        cutter = threading.Thread(target=take_cuts, daemon=True)
        cutter.start()
        for moment, kind in zip(moments, kinds):
            wait_until(lambda m=moment: _applied(ledger_path) >= m * ROWS, 240, f"{moment:.0%} of rows applied")
            if kind == "master":
                master.kill()
                master.start()  # same state dir, same port: workers reconnect
            else:
                name = rng.choice(sorted(workers))
                workers[name].kill()
                workers[name].wait()
                workers[name] = _worker(master, ledger_path, name, 2_000)
            print(f"killed {kind} at {moment:.0%}")
        outputs = {}
        for name, proc in workers.items():
            out, _ = proc.communicate(timeout=300)
            outputs[name] = out.decode(errors="replace")
            assert proc.returncode == 0, f"{name} failed:\n{outputs[name]}"
        stop_cuts.set()
        cutter.join(timeout=60)

        final_id, final_cursor = admin.prepare_cut()
        admin.commit_cut(final_id)
        info = admin.describe_dataset("rows")
    finally:
        admin.close()
        master.stop()

    ledger = Ledger(ledger_path)
    report = ledger.verify(ids)
    print(report, cuts)
    assert report.exact, f"seed {seed}: {report}"
    assert report.conflicts == 0, "a live worker found its shard moved under it: two live leases on one shard"
    assert master.starts == 2
    assert cuts["committed"] > 0
    assert info.finished and info.records_committed == ROWS
    # The committed cursor covers every row of every partition once, and matches the ledger's own positions.
    for part in info.partitions:
        assert final_cursor.get(_key(part.id)) == IntervalSet([(part.start, part.end)])
    assert sum(ledger.positions().values()) > 0
    ledger.close()


def _key(partition: str):  # type: ignore[no-untyped-def]
    from streamrover.cursor import PartitionKey

    return PartitionKey("rows", 0, partition)


def test_ledger_detects_double_application(tmp_path: Path) -> None:
    """The ledger is a real check: applying a range twice (the bug it exists to catch) is reported."""
    ledger = Ledger(tmp_path / "l.db")
    ledger.apply("s/0/0/0-3", 0, 3, np.array([0, 1, 2]), "a")
    ledger._db.execute("DELETE FROM positions")  # forget the position, as a broken sink would
    ledger.apply("s/0/0/0-3", 0, 3, np.array([0, 1, 2]), "b")
    report = ledger.verify(np.arange(4))
    assert not report.exact
    assert report.duplicates == 3 and report.missing == 1
