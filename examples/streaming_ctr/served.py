"""The demo's served model: the exported versions, the real model server, live records scored by it.

``make demo`` adds an ``export:`` section to the job (every durable checkpoint becomes an ONNX version of
``ctr`` in ``<work>/models``, train.py's exporter) and :class:`ServedProbe` does the rest:

1. starts KServe's model server (streamrover/serving/server.py, in the serving venv of
   scripts/build-serving-venv.sh) on that repository, polling it every :data:`POLL` s;
2. reads the topic as a client application would (its own consumer, from the beginning, nothing committed)
   and sends each record, as it arrives, to the server for a prediction: the served model scores records it
   has not learned from, so their AUC is the served model's progressive AUC, next to the trainer's;
3. notes the first moment the server answers with each version and reads that version's lineage (the offset
   ranges its checkpoint learned from), so a record is *served* at the first answer of a version holding it:
   freshness from event to served;
4. reports the served version and its lineage to the job master (reporter ``serving``: the dashboard and
   ``/metrics`` show them) and a line to the live view.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from examples.streaming_ctr import metrics
from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC

ROOT = Path(__file__).resolve().parents[2]
NAME = "ctr"
POLL = 0.1  # seconds between the server's polls of the repository
BATCH = 0.05  # seconds the client waits for more records before it sends what it has
REQUEST = 500  # records per prediction request, at most
WATCH = 0.1  # seconds between the version watcher's requests
SAMPLE = 4  # the client scores records whose id is a multiple of this (a share of the traffic: two cores here)
BEHIND = 2.0  # seconds: older records are skipped, not scored (a client answers what arrives now)
_COLS = 6  # id, served logit, clicked, event_ms, answered_ms, version


def export_section(repository: Path, keep_last: int = 8, base_every: int = 10) -> dict[str, Any]:
    """The job spec's ``export:`` section the demo adds."""
    return {"repository": str(repository), "name": NAME, "keep_last": keep_last, "base_every": base_every}


def serving_python() -> str:
    """The serving venv's python (built once per machine; ``make serving-venv``)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build-serving-venv.sh")], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/build-serving-venv.sh failed (the model server's venv):\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServedSummary:
    """What the served model did: versions answered, progressive AUC, freshness from event to served."""

    versions: int  # distinct versions the server answered with
    lineages: int  # of those, versions whose lineage.json the client read when it first saw them
    scored: int  # records scored by a version that had not learned them (progressive)
    learned_before: int  # records scored only after the scoring version had learned them (left out of the AUC)
    unserved: int  # records never scored (the client stopped first)
    skipped: int  # sampled records skipped: more than BEHIND s old (the client behind, or no version served yet)
    auc: float  # progressive AUC of the served predictions
    trainer_auc: float  # the trainer's progressive AUC over the same windows
    score_delay_p50_s: float  # event time to the client's answer
    fresh_p50_s: float  # event time to the first answer of a version holding the record
    fresh_p99_s: float
    covered: int  # records some answered version held
    newest: int  # the newest version answered
    newest_positions: int  # offsets its lineage holds
    request_ms: float  # median round trip of a prediction request (up to REQUEST records)
    diagnosis: str = ""  # the repository, the exporter's log lines, the server's log tail (ServedProbe.diagnosis)


class ServedProbe:
    """The model server and a client sending it the live records (see the module docstring)."""

    def __init__(self, work: Path, bootstrap: str, topic: str, partitions: int, repository: Path,
                 start: dict[int, int] | None = None) -> None:  # fmt: skip
        self.work, self.bootstrap, self.topic, self.partitions = work, bootstrap, topic, partitions
        self.start_offsets = start or {}  # partition -> first offset to send (the first act's seam), else the first
        self.repository = repository
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/models/{NAME}:predict"
        self.server: subprocess.Popen[bytes] | None = None
        self.rows: list[np.ndarray] = []  # _COLS columns per scored record
        self.partition_offsets: list[np.ndarray] = []  # (partition, offset) per scored or unserved record
        self.all_rows: list[np.ndarray] = []  # id, event_ms of every record read (scored or not)
        self.seen: dict[int, float] = {}  # version -> first answer (epoch s)
        self.lineage: dict[int, dict[int, list[list[int]]]] = {}  # version -> partition -> learned ranges
        self.unserved = 0
        self.skipped = 0  # sampled records more than BEHIND s old when their turn came
        self.read = 0
        self.errors: list[str] = []
        self.request_s: list[float] = []  # each scoring request's round trip
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._reported = -1
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the server (it waits for a first version) and the client thread."""
        python = serving_python()
        self.repository.mkdir(parents=True, exist_ok=True)
        with open(self.work / "server.log", "ab") as log:
            self.server = subprocess.Popen([python, "-m", "streamrover.serving.server", "--repository",
                                            str(self.repository), "--name", NAME, "--http-port", str(self.port),
                                            "--poll", str(POLL)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                           env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="served-probe", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch, name="served-versions", daemon=True)
        self._watcher.start()

    # -- the client --------------------------------------------------------------------
    def _predict(self, cats: list[list[int]], nums: list[list[float]]) -> tuple[int, np.ndarray] | None:
        body = json.dumps({"instances": [{"cats": c, "nums": n} for c, n in zip(cats, nums, strict=True)]}).encode()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                doc = json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None  # no version served yet (the server starts serving with the first one)
        version = int(doc["model_version"])
        with self._lock:
            first = version not in self.seen
            if first:
                self.seen[version] = time.time()
        if first:
            self._read_lineage(version)
        return version, np.asarray(doc["predictions"], dtype=np.float64).reshape(-1)

    def _read_lineage(self, version: int) -> None:
        try:
            doc = json.loads((self.repository / NAME / str(version) / "lineage.json").read_text())
        except (OSError, ValueError) as exc:  # retired (a restore) between the answer and this read
            self.errors.append(f"version {version}: lineage not read ({exc})")
            return
        learned: dict[int, list[list[int]]] = {}
        for entry in doc["lineage"].get("learned", []):
            learned.setdefault(int(str(entry["partition"]).rsplit("-", 1)[1]), []).extend(entry["ranges"])
        self.lineage[version] = learned

    def _watch(self) -> None:
        """Ask the server for its version every :data:`WATCH` s (one row): when each version is first answered."""
        probe = ([[1] * len(CATEGORICAL)], [[0.0] * len(NUMERIC)])
        while not self._stop.wait(WATCH):  # a client's request interval
            self._predict(*probe)

    def _run(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"demo-served-{uuid.uuid4().hex[:8]}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest",
                             "fetch.wait.max.ms": 20})  # a live client: records as soon as they are there  # fmt: skip
        consumer.assign([TopicPartition(self.topic, p, self.start_offsets.get(p, OFFSET_BEGINNING))
                         for p in range(self.partitions)])  # fmt: skip
        pending: list[tuple[Any, dict[str, Any]]] = []  # sampled, not scored yet
        try:
            while not self._stop.is_set():
                msgs = [m for m in consumer.consume(num_messages=REQUEST, timeout=BATCH) if m.error() is None]
                self.read += len(msgs)
                docs = [(m, json.loads(m.value())) for m in msgs]
                pending += [(m, d) for m, d in docs if int(d["id"]) % SAMPLE == 0]
                now_ms = time.time() * 1000
                keep = [(m, d) for m, d in pending if now_ms - d["event_ms"] <= BEHIND * 1000]
                self.skipped += len(pending) - len(keep)
                pending = keep
                while pending and not self._stop.is_set():
                    msgs, rest = pending[:REQUEST], pending[REQUEST:]
                    if not self._score(msgs):
                        break  # no version served yet: keep them
                    pending = rest
        except Exception as exc:  # reported in the summary, never a silent stop
            self.errors.append(f"client: {type(exc).__name__}: {exc}")
        finally:
            self.unserved = len(pending)
            consumer.close()

    def _score(self, items: list[tuple[Any, dict[str, Any]]]) -> bool:
        msgs, docs = [m for m, _ in items], [d for _, d in items]
        sent = time.perf_counter()
        answer = self._predict([[d[c] for c in CATEGORICAL] for d in docs], [[d[c] for c in NUMERIC] for d in docs])
        if answer is None:
            return False
        self.request_s.append(time.perf_counter() - sent)
        version, logits = answer
        rows = np.empty((len(docs), _COLS))
        rows[:, 0], rows[:, 1] = [d["id"] for d in docs], logits
        rows[:, 2], rows[:, 3] = [d["clicked"] for d in docs], [d["event_ms"] for d in docs]
        rows[:, 4], rows[:, 5] = time.time() * 1000, version
        self.rows.append(rows)
        self.partition_offsets.append(np.asarray([(m.partition(), m.offset()) for m in msgs], dtype=np.int64))
        return True

    # -- the live view and the dashboard ---------------------------------------------------
    def line(self) -> str:
        """One line for the live view: the served version and what its lineage holds."""
        newest = self.newest()
        if newest < 0:
            return "served: no version yet"
        held = self.lineage.get(newest, {})
        ranges = ", ".join(f"p{p} {r[0][0]:,}-{r[-1][1]:,}" for p, r in sorted(held.items()) if r)
        return f"served: version {newest} (learned {ranges or '-'}), {self.scored():,} records scored live"

    def scored(self) -> int:
        return sum(len(r) for r in self.rows)

    def report(self, client: Any) -> None:
        """Report the served version and its lineage to the master (reporter ``serving``), once per version."""
        newest = self.newest()
        if client is None or newest < 0 or newest == self._reported:
            return
        values = {"served_version": float(newest), "served_records_scored": float(self.scored())}
        for p, ranges in self.lineage.get(newest, {}).items():
            values[f"served_learned_p{p}_end"] = float(max(r[1] for r in ranges))
            values[f"served_learned_p{p}_positions"] = float(sum(r[1] - r[0] for r in ranges))
        try:
            client.report(values, step=newest, reporter="serving")
            self._reported = newest
        except Exception as exc:  # the master may be restarting: the next sample reports
            self.errors.append(f"report: {exc}")

    # -- the end ------------------------------------------------------------------------------
    def finish(self, records: int, timeout: float = 20.0) -> None:
        """Wait (bounded) until a served version holds every record, then stop the client and the server."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up and self._held() < records and self._thread and self._thread.is_alive():
            time.sleep(POLL)  # the last versions reaching the server (bounded)
        self.stop()

    def _held(self) -> int:
        newest = self.newest()
        return sum(r[1] - r[0] for ranges in self.lineage.get(newest, {}).values() for r in ranges)

    def newest(self) -> int:
        """The newest version answered so far (-1: none)."""
        with self._lock:
            return max(self.seen, default=-1)

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._watcher):
            if thread is not None:
                thread.join(30)
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()

    def _holds(self, version: int, where: np.ndarray) -> np.ndarray:
        """Which of the records at ``where`` (partition, offset) version ``version``'s lineage holds."""
        held = np.zeros(len(where), dtype=bool)
        for p, ranges in self.lineage.get(version, {}).items():
            for start, end in ranges:
                held |= (where[:, 0] == p) & (where[:, 1] >= start) & (where[:, 1] < end)
        return held

    def summarize(self, out: Path, window: int, trainer_rows: np.ndarray) -> ServedSummary:
        """The served figures; writes ``served.npy`` (the records scored progressively) and ``served_fresh.npy``."""
        rows = np.concatenate(self.rows) if self.rows else np.empty((0, _COLS))
        where = np.concatenate(self.partition_offsets) if self.partition_offsets else np.empty((0, 2), np.int64)
        served_at = np.full(len(rows), np.nan)
        for version in sorted(self.seen, key=self.seen.__getitem__):  # first answered first
            served_at[np.isnan(served_at) & self._holds(version, where)] = self.seen[version]
        fresh = served_at - rows[:, 3] / 1000
        fresh = fresh[~np.isnan(fresh)]
        np.save(out / "served_fresh.npy", fresh)
        learned = np.zeros(len(rows), dtype=bool)  # scored by a version that had learned them: not progressive
        for version in np.unique(rows[:, 5]).astype(int):
            mine = rows[:, 5] == version
            learned[mine] = self._holds(int(version), where[mine])
        progressive = rows[~learned]
        np.save(out / "served.npy", progressive)
        served_rows = self.window_rows(progressive, window, trainer_rows.shape[0])
        both = [i for i in range(len(served_rows)) if served_rows[i, 4 * metrics.BINS] > 0]
        newest = max(self.seen, default=-1)
        q = (lambda a, x: float(np.quantile(a, x)) if len(a) else float("nan"))  # noqa: E731
        return ServedSummary(
            versions=len(self.seen), lineages=len(self.lineage), scored=len(progressive),
            learned_before=int(learned.sum()),
            unserved=self.unserved, skipped=self.skipped,
            auc=metrics.merged(served_rows).auc if len(progressive) else float("nan"),
            trainer_auc=metrics.merged(trainer_rows[both]).auc if both else float("nan"),
            score_delay_p50_s=q((rows[:, 4] - rows[:, 3]) / 1000, 0.5), fresh_p50_s=q(fresh, 0.5),
            fresh_p99_s=q(fresh, 0.99), covered=len(fresh), newest=newest,
            newest_positions=sum(r[1] - r[0] for v in self.lineage.get(newest, {}).values() for r in v),
            request_ms=q(np.asarray(self.request_s), 0.5) * 1000,
        )  # fmt: skip

    def diagnosis(self, logs: Path, lines: int = 15) -> str:
        """What a failure message needs when versions are missing: the versions in the repository, the workers'
        export log lines (the exporter logs each version and every failure), the model server's log tail."""
        model_dir = self.repository / NAME
        entries = sorted(os.listdir(model_dir)) if model_dir.is_dir() else []
        out = [f"repository {model_dir}: {entries or 'empty'}"]
        for path in sorted(logs.glob("*")) if logs.is_dir() else []:
            if not path.is_file():
                continue
            found = [ln for ln in path.read_text(errors="replace").splitlines() if "export" in ln.lower()]
            out += [f"{path.name}: {ln}" for ln in found[-lines:]]
        server_log = self.work / "server.log"
        if server_log.is_file():
            out += ["server.log:", *server_log.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)

    @staticmethod
    def window_rows(rows: np.ndarray, window: int, n_windows: int) -> np.ndarray:
        """Progressive-validation window rows of the served predictions (the trainer's layout; no oracle)."""
        out = np.zeros((n_windows, metrics.ROW))
        if len(rows):
            w = np.clip(rows[:, 0].astype(np.int64) // window, 0, n_windows - 1)
            out += metrics.window_rows(w, rows[:, 1], rows[:, 1], rows[:, 2], rows[:, 3], 0.0, n_windows)
        return out


def describe(s: ServedSummary) -> list[tuple[str, str]]:
    """The report's rows for the served model."""
    return [
        ("served: versions answered (KServe + onnxruntime)", f"{s.versions}, newest {s.newest} "
                                                              f"({s.newest_positions:,} offsets learned)"),
        ("served: records scored live (answer p50 after event; request p50)",
         f"{s.scored:,} ({s.score_delay_p50_s:.2f} s; {s.request_ms:.0f} ms)"),
        ("served: scored after being learned / skipped (> 2 s old) / never scored",
         f"{s.learned_before:,} / {s.skipped:,} / {s.unserved:,}"),
        ("served: progressive AUC (trainer's on the same windows)", f"{s.auc:.4f} ({s.trainer_auc:.4f})"),
        ("freshness p50 / p99 (event time to served)", f"{s.fresh_p50_s:.2f} s / {s.fresh_p99_s:.2f} s"),
    ]  # fmt: skip


def plots(out: Path, probe: ServedProbe, trainer_rows: np.ndarray, window: int, drift_at: int,
          applied_fresh: np.ndarray) -> list[Path]:
    """``served_auc.png`` (served vs trainer progressive AUC per window) and ``served_freshness.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = np.load(out / "served.npy")
    served = {f.index: f for f in metrics.figures(ServedProbe.window_rows(rows, window, trainer_rows.shape[0]), 200)}
    trainer = {f.index: f for f in metrics.figures(trainer_rows, 200)}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = sorted(trainer)
    ax.plot([(i + 0.5) * window for i in xs], [trainer[i].auc for i in xs], "o-", label="trainer (progressive)")
    xs = sorted(served)
    ax.plot([(i + 0.5) * window for i in xs], [served[i].auc for i in xs], "^-", label="served (live requests)")
    ax.plot([(i + 0.5) * window for i in sorted(trainer)], [trainer[i].oracle_auc for i in sorted(trainer)], "s--",
            label="oracle", alpha=0.6)  # fmt: skip
    ax.axvline(drift_at, color="red", lw=1, label="drift")
    ax.set_xlabel("record id (window midpoint)")
    ax.set_ylabel("AUC")
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths = [out / "served_auc.png"]
    fig.savefig(paths[0], dpi=90)
    plt.close(fig)
    fresh = np.load(out / "served_fresh.npy")
    fig, ax = plt.subplots(figsize=(7, 2.6))
    edges = metrics.FRESH_EDGES_MS / 1000
    mids = np.sqrt(np.maximum(edges[:-1], 0.0005) * edges[1:])
    ax.bar(mids, applied_fresh, width=np.diff(edges), align="center", alpha=0.6, label="event to applied (trainer)")
    counts = np.bincount(np.clip(np.searchsorted(edges, fresh, side="right") - 1, 0, len(edges) - 2),
                         minlength=len(edges) - 1)  # fmt: skip
    ax.bar(mids, counts, width=np.diff(edges), align="center", alpha=0.6, label="event to served")
    ax.set_xscale("log")
    ax.set_xlim(0.05, max(float(fresh.max()) if len(fresh) else 10.0, 10.0) * 1.5)
    ax.set_xlabel("seconds")
    ax.set_ylabel("records")
    ax.legend(loc="upper left")
    fig.tight_layout()
    paths.append(out / "served_freshness.png")
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)
    return paths
