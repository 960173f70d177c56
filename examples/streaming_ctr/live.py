"""What the demo watches while the job runs: samples of the master's status, the trainer's metrics, the producer.

:class:`Watcher` reads, each time it is asked: the job's status document (``streamrover status``'s
source: nodes, worker pids, restarts), the master's Status RPC (lag, records/s, acked,
committed), the trainer's ``metrics.json`` (the newest windows' AUC and the oracle's) and the
producer's progress file. :func:`render` turns the newest sample into a rich table.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from streamrover.operator.jobs import JobDir
from streamrover.shard_service import ShardClient, ShardServiceError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON document written atomically by another process ({} until it exists)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


@dataclass
class Sample:
    """One moment of the run."""

    t: float
    produced: int = 0
    acked: int = 0
    committed: int = 0
    lag: int = 0
    records_per_second: float = 0.0
    restarts: int = 0
    workers: int = 0  # worker processes the node's agent reports running
    joined: int = 0  # ranks joined to the shard service (their StreamSession is up)
    applied: int = 0
    auc: float = float("nan")
    oracle_auc: float = float("nan")
    window: int = -1
    fresh_p50_ms: float = float("nan")
    fresh_p99_ms: float = float("nan")
    phase: str = "starting"
    dashboard: str = ""
    events: list[str] = field(default_factory=list)


class Watcher:
    """Samples the run (see the module docstring); keeps every sample for the report's plots."""

    def __init__(self, job: JobDir, out: Path, progress: Path, dataset: str = "clicks", per_node: int = 3) -> None:
        self.job, self.out, self.progress, self.dataset, self.per_node = job, out, progress, dataset, per_node
        self.samples: list[Sample] = []
        self._client: ShardClient | None = None
        self.t0 = time.time()

    def _master(self, doc: dict[str, Any]) -> ShardClient | None:
        if self._client is None and doc.get("master") and doc.get("state_dir"):
            token_file = Path(doc["state_dir"]) / "token"
            if token_file.exists():
                self._client = ShardClient(doc["master"], token=token_file.read_text().strip(), heartbeat=False,
                                           timeout=10, name="demo-watcher")  # fmt: skip
        return self._client

    @property
    def client(self) -> ShardClient | None:
        """The master's client once the master is up (None before)."""
        return self._client

    def sample(self) -> Sample:
        doc = self.job.status() if self.job.status_path.exists() else {}
        s = Sample(time.time() - self.t0, phase=str(doc.get("phase", "starting")))
        nodes = doc.get("nodes", [])
        s.workers = sum(len(n.get("workers", {})) for n in nodes if n.get("state") == "running")
        s.restarts = int(doc.get("relaunches", 0)) + sum(
            self.per_node - n["restarts_left"] for n in nodes if n.get("restarts_left") is not None)  # fmt: skip
        s.events = [f"{e['kind']} {e['node']}: {e['message']}" for e in doc.get("events", [])[-3:]]
        if doc.get("state_dir"):
            url = Path(doc["state_dir"]) / "dashboard.url"
            s.dashboard = url.read_text().strip() if url.exists() else ""
        client = self._master(doc)
        if client is not None:
            try:
                st = client.status()
                ds = next((d for d in st.datasets if d.spec.name == self.dataset), None)
                if ds is not None:
                    s.acked, s.committed, s.lag = int(ds.records_acked), int(ds.records_committed), int(ds.lag)
                s.records_per_second = float(st.records_per_second)
                s.joined = sum(1 for w in st.workers if w.name.startswith("rank"))
            except ShardServiceError:
                pass  # the master is stopping or restarting: no figures this time
        m = read_json(self.out / "metrics.json")
        s.applied = int(m.get("applied", 0))
        s.fresh_p50_ms = float(m.get("fresh_p50_ms", float("nan")))
        s.fresh_p99_ms = float(m.get("fresh_p99_ms", float("nan")))
        full = [w for w in m.get("windows", []) if w["records"] >= 1000]
        if full:
            last = full[-1]
            s.window, s.auc, s.oracle_auc = int(last["index"]), float(last["auc"]), float(last["oracle_auc"])
        s.produced = int(read_json(self.progress).get("sent", 0))
        self.samples.append(s)
        return s

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps([asdict(s) for s in self.samples]))


def render(s: Sample, records: int, note: str = "", served: str = "") -> Table:
    """The live view: one table of the newest sample."""
    table = Table(title=f"streaming CTR  t={s.t:5.0f}s  job {s.phase}", show_header=True, expand=False)
    for col in ("produced", "in model", "lag", "records/s", "AUC (window)", "oracle AUC", "AUC/oracle",
                "fresh p50/p99", "workers", "restarts"):  # fmt: skip
        table.add_column(col, justify="right")
    ratio = s.auc / s.oracle_auc if s.oracle_auc == s.oracle_auc and s.oracle_auc else float("nan")
    table.add_row(
        f"{s.produced:,}/{records:,}", f"{s.applied:,}", f"{s.lag:,}", f"{s.records_per_second:,.0f}",
        f"{s.auc:.3f} (w{s.window})" if s.window >= 0 else "-", f"{s.oracle_auc:.3f}" if s.window >= 0 else "-",
        f"{ratio:.3f}" if ratio == ratio else "-",
        f"{s.fresh_p50_ms / 1000:.1f}/{s.fresh_p99_ms / 1000:.1f}s" if s.fresh_p50_ms == s.fresh_p50_ms else "-",
        str(s.workers), str(s.restarts),
    )  # fmt: skip
    caption = [c for c in (note, served) if c]
    if s.dashboard:
        caption.append(f"dashboard and /metrics: {s.dashboard} (the job's token)")
    if caption:
        table.caption = "; ".join(caption)
    return table
