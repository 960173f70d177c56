"""A streaming ledger job for tests: a master, ledger workers, a checkpointing loop, and chaos."""

from __future__ import annotations

import random
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.ledger import Ledger, LedgerReport
from streamrover.testing.procs import MasterProcess, start_ledger_worker
from tests.helpers import wait_until


@dataclass
class StreamJob:
    workdir: Path
    uri: str
    options: dict[str, str]
    records_per_shard: int = 500
    workers: int = 2
    batch_size: int = 200
    master: MasterProcess = field(init=False)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ledger_path: Path = field(init=False)
    cuts_committed: int = 0
    events: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ledger_path = self.workdir / "ledger.db"
        Ledger(self.ledger_path).close()
        self.master = MasterProcess(self.workdir / "master", lease_ttl=2.0)
        self._stop_cuts = threading.Event()
        self._cutter: threading.Thread | None = None

    def start(self) -> None:
        self.master.start()
        with self.admin() as admin:
            spec = DatasetSpec("stream", self.uri, options=self.options, records_per_shard=self.records_per_shard)
            admin.register_dataset(spec)
        for i in range(self.workers):
            self.start_worker(f"w{i}")
        self._cutter = threading.Thread(target=self._take_cuts, daemon=True)
        self._cutter.start()

    def admin(self) -> ShardClient:
        return ShardClient(self.master.address, token=self.master.token, heartbeat=False, timeout=90)

    def start_worker(self, name: str) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.procs[name] = start_ledger_worker(
                self.master, "stream", self.ledger_path, name=name, batch_size=self.batch_size, stdout=log
            )

    def kill_worker(self, rng: random.Random) -> None:
        name = rng.choice(sorted(self.procs))
        self.procs[name].kill()
        self.procs[name].wait()
        self.events.append(f"SIGKILL {name}")
        self.start_worker(name)

    def kill_master(self) -> None:
        self.master.kill()
        self.master.start()
        self.events.append("SIGKILL master")

    def _take_cuts(self) -> None:
        with self.admin() as client:
            while not self._stop_cuts.wait(0.3):
                cut_id, _ = client.prepare_cut()
                client.commit_cut(cut_id)
                self.cuts_committed += 1

    def applied(self) -> int:
        led = Ledger(self.ledger_path)
        try:
            return int(led._db.execute("SELECT COALESCE(SUM(count), 0) FROM chunks").fetchone()[0])
        finally:
            led.close()

    def run_chaos(self, total: int, actions: list[Callable[[], None]], rng: random.Random) -> None:
        """Run each action once the ledger holds a random fraction of ``total`` records."""
        moments = sorted(rng.uniform(0.1, 0.8) for _ in actions)
        for moment, action in zip(moments, actions):
            wait_until(lambda m=moment: self.applied() >= m * total, 180, f"{moment:.0%} of {total} records applied")
            action()

    def finish(
        self, total: int, timeout: float = 180, ids: np.ndarray | None = None
    ) -> tuple[LedgerReport, DataCursor, object]:
        """Wait for every record, take a final cut, stop everything; returns (ledger report, cursor, dataset info).

        ``ids``: the records expected in the ledger (default ``range(total)``; ``total`` of them).
        """
        wait_until(lambda: self.applied() >= total, timeout, f"all {total} records applied")
        with self.admin() as admin:
            # Applied is not yet acked: workers send queued acks a little later (progress acks linger). The final
            # cut is taken once the master has recorded an ack for every position the source reports (or
            # accounted it as lost: deleted upstream before it was trained, sr.on_data_loss=skip).
            # Counted in records (status never counts position differences: Pulsar's jump at ledger rollovers).
            def all_acked() -> bool:
                info = admin.describe_dataset("stream")
                planned = all(p.end == p.available_end for p in info.partitions)
                return planned and info.records_acked + info.lost_records >= info.total_records

            wait_until(all_acked, timeout, "every applied record's ack recorded by the master")
        cursor = self.finish_cut()
        with self.admin() as admin:
            info = admin.describe_dataset("stream")
        expected = np.arange(total) if ids is None else ids
        return Ledger(self.ledger_path).verify(expected), cursor, info

    def wait_outage_cleared(self, timeout: float = 60) -> None:
        """Wait until the dataset's status no longer reports a source error, and check it did not fail.

        Not asserted at one instant: a restarted broker answers some requests with retriable errors for a while
        (Kafka's UNKNOWN_LEADER_EPOCH was seen in CI after every record had been planned), and the master says
        so in status until a poll succeeds again.
        """
        with self.admin() as admin:
            wait_until(lambda: admin.describe_dataset("stream").error == "", timeout, "the outage report to clear")
            info = admin.describe_dataset("stream")
            assert not info.failed, info.error

    def finish_cut(self) -> DataCursor:
        """Stop taking cuts, then take and commit a final one, twice; returns its cursor.

        Upstream commits lag durable storage by one checkpoint (``committed_positions``): the broker's group
        offsets reach the final cursor once a second cut with the same cursor commits (a second checkpoint of
        the drained stream), as a run that ends would take it.
        """
        self._stop_cuts.set()
        if self._cutter is not None:
            self._cutter.join(timeout=60)
        with self.admin() as admin:
            cut_id, cursor = admin.prepare_cut()
            admin.commit_cut(cut_id)
            again, same = admin.prepare_cut()  # nothing was acked since: the same cursor
            assert same == cursor, f"acks after the final cut: {cursor} then {same}"
            admin.commit_cut(again)
        return cursor

    def stop(self) -> None:
        self._stop_cuts.set()
        if self._cutter is not None:  # its call in flight answered first: a stopped master would leave it retrying
            self._cutter.join(timeout=10)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.master.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(self.workdir.glob("*.log"))
        )
