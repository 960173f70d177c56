"""The flagship demo, shortened: online CTR from a live Kafka (tansu) topic, a worker SIGKILLed, the report.

examples/streaming_ctr/demo.py as ``make demo`` runs it, with fewer records: the first act trains the first
:data:`HISTORY` records from their Kafka-Connect-style Parquet export of the topic (first_act.py), then the
producer writes the rest of :data:`RECORDS` click records at :data:`RATE`/s with one concept drift at :data:`DRIFT`;
``streamrover run`` trains the DeepFM job (two DDP workers under dlrover-run); one worker is
SIGKILLed once 30% of the records are acked. Asserted, from the model's own state at the end:

- the ledger is exact: every record applied once (none missing, none twice), across the seam too;
- progressive AUC over the :data:`BEFORE` records before the drift >= 0.95 x the oracle's AUC on them;
- after the drift, a window is back to >= 0.9 x the oracle within :data:`RECOVER_WITHIN` records;
- the served model (every durable checkpoint exported, KServe's model server polling the repository, a
  quarter of the records sent to it as they arrive): it answered with many versions, every one with its
  lineage, scored records it had not learned from with a progressive AUC close to the trainer's on the same
  windows, and every record reached a served version: event to served p99 within :data:`SERVED_P99` s (the
  issue's bound, which ``python -m benchmarks serving`` measures at the demo's rate without a SIGKILL), or
  within :data:`SERVED_OVER_APPLIED` s of event to applied in the same run (the SIGKILL's restart and a
  loaded machine delay both: on two cores shared with other jobs the probe skips what it cannot score in time);
- the report's plots and HTML page were written.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from examples.streaming_ctr import report
from examples.streaming_ctr.demo import DemoConfig, run_demo
from examples.streaming_ctr.served import SAMPLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RECORDS, DRIFT, RATE = 100_000, 60_000, 2_500
BEFORE, RECOVER_WITHIN, HISTORY = 10_000, 30_000, 20_000
SERVED_P99, SERVED_OVER_APPLIED = 5.0, 5.0


def test_shortened_demo_is_exact_and_tracks_the_oracle_through_a_drift(tmp_path: Path, tansu_broker: Any) -> None:
    cfg = DemoConfig(records=RECORDS, drift_at=DRIFT, rate=RATE, kill_at=0.3, bootstrap=tansu_broker.bootstrap,
                     workdir=tmp_path, timeout=800, history=HISTORY)  # fmt: skip
    log = io.StringIO()
    summary, work = run_demo(cfg, Console(file=log, width=120), live=False)
    table = "\n".join(f"{k}: {v}" for k, v in report.describe(summary))
    print(table)
    assert summary.killed, log.getvalue()
    assert summary.restarts >= 1, table
    assert summary.exact and summary.applied == RECORDS, table
    assert summary.before_ratio >= 0.95, table
    assert summary.recovered_after is not None and summary.recovered_after <= RECOVER_WITHIN, table
    seam = dict(summary.seam)
    assert seam[f"ids {HISTORY - 2_000:,}..{HISTORY + 1_999:,} (both sides of the seam) each once"] == "yes", table
    assert seam["first act: the past, from Parquet"].startswith(f"{HISTORY:,} records in "), table
    served = summary.served
    assert served is not None, table
    why = f"{table}\n--- the exporter and the model server:\n{served.diagnosis}"  # what a CI failure needs
    assert served.versions >= 10 and served.lineages == served.versions and served.newest_positions == RECORDS, why
    assert served.scored >= min(1000, RECORDS // SAMPLE), why
    assert served.covered == served.scored + served.learned_before, why
    assert served.auc >= 0.95 * served.trainer_auc, why
    assert served.fresh_p99_s <= max(SERVED_P99, summary.fresh_p99_ms / 1000 + SERVED_OVER_APPLIED), why
    out = work / "out"
    for name in ("auc.png", "lag.png", "throughput.png", "freshness.png", "served_auc.png", "served_freshness.png"):
        assert (out / name).stat().st_size > 1000, name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6 and "exactly once" in page and "event time to served" in page
