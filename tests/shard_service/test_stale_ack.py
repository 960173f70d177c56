"""A worker frozen (SIGSTOP) past its lease: the shard is finished elsewhere, its late ack is refused."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, start_ledger_worker
from tests.helpers import write_parquet_dataset

ROWS = 40_000


def _worker(master: MasterProcess, ledger: Path, *extra: str) -> subprocess.Popen[bytes]:
    return start_ledger_worker(master, "rows", ledger, batch_size=1000, extra=list(extra))


def test_resumed_worker_ack_is_refused_and_ledger_exact(tmp_path: Path, master: MasterProcess) -> None:
    ids = write_parquet_dataset(tmp_path / "data", ROWS, files=2, row_group_size=10_000)
    ledger_path = tmp_path / "ledger.db"
    Ledger(ledger_path).close()
    with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
        admin.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=5_000))

        # Worker A writes its 3rd batch to the ledger, then stops itself before acking it.
        frozen = _worker(master, ledger_path, "--pause-at-batch", "3", "--name", "frozen")
        _, status = os.waitpid(frozen.pid, os.WUNTRACED)  # returns once A is stopped
        assert os.WIFSTOPPED(status)

        # Worker B runs the whole dataset: it gets A's shard once A's lease expires (A sends no heartbeats).
        other = _worker(master, ledger_path, "--name", "other")
        out_b, _ = other.communicate(timeout=120)
        assert other.returncode == 0, out_b.decode()
        info = admin.describe_dataset("rows")
        assert info.finished, "B should have finished every shard, A's included"

        os.kill(frozen.pid, signal.SIGCONT)
        out_a, _ = frozen.communicate(timeout=60)
        text_a = out_a.decode()
        assert frozen.returncode == 0, text_a

    # A's late ack named the shard and both attempts, and was refused. Acks are queued, so the refusal
    # may reach A after its heartbeat learnt of the revocation: look for the master's answer among A's reports.
    refused = [line for line in text_a.splitlines() if line.startswith("ACK REFUSED")]
    fenced = [line for line in refused if "leased again as attempt" in line]
    assert fenced, text_a
    assert "attempt" in fenced[0] and "rows/0/" in fenced[0], fenced[0]
    assert "ACK ACCEPTED" not in text_a

    ledger = Ledger(ledger_path)
    report = ledger.verify(ids)
    assert report.exact, str(report)
    assert report.catchups >= 1, "B must have found A's unacked batch in the ledger and acked it, not rewritten it"
    ledger.close()
