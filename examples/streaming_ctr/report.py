"""The demo's final report: exactly-once, AUC against the oracle around the drift, freshness, throughput, plots.

:func:`summarize` reads the trainer's final arrays (``ledger.npy``, ``windows.npy``,
``freshness.npy``) and the demo's samples and returns the figures; :func:`plots` draws the
PNGs (matplotlib, no display) and :func:`write_html` writes ``report.html`` with them embedded.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from examples.streaming_ctr import metrics


@dataclass
class Summary:
    records: int
    applied: int
    duplicates: int
    missing: int
    exact: bool
    drift_at: int
    before_auc: float
    before_oracle_auc: float
    before_ratio: float
    before_logloss: float
    before_oracle_logloss: float
    dip_ratio: float  # the first window after the drift
    recovered_after: int | None  # records after the drift until a window is back to >= recover_ratio of the oracle
    recover_ratio: float
    final_ratio: float  # the last 2 windows
    calibration: float
    fresh_p50_ms: float
    fresh_p99_ms: float
    records_per_second: float  # records applied / seconds from the first step to the last
    peak_records_per_second: float
    killed: str
    restarts: int
    seam: list[tuple[str, str]] = field(default_factory=list)  # the first act's rows (first_act.py), if any
    served: Any = None  # served.ServedSummary when the demo served the model


def summarize(out: Path, records: int, drift_at: int, window: int, samples: list[dict[str, Any]],
              killed: str, recover_ratio: float = 0.9, before: int = 10_000) -> Summary:
    """The report's figures (see the module docstring)."""
    ledger = np.load(out / "ledger.npy")
    rows = np.load(out / "windows.npy")
    fresh = np.load(out / "freshness.npy")
    figs = {f.index: f for f in metrics.figures(rows)}
    lo = max(drift_at - before, 0) // window
    pre = metrics.merged(rows[lo: drift_at // window])
    post = [figs[i] for i in sorted(figs) if i >= drift_at // window]
    recovered = next(((f.index + 1) * window - drift_at for f in post if f.auc_ratio >= recover_ratio), None)
    last = metrics.merged(rows[-2:])
    first, last_ms = np.load(out / "applied_span.npy")
    span = (last_ms - first) / 1000
    rates = [s["records_per_second"] for s in samples]
    return Summary(
        records, int(ledger.sum()), int((ledger > 1).sum()), int((ledger == 0).sum()),
        bool(ledger.shape == (records,) and np.all(ledger == 1)), drift_at, pre.auc, pre.oracle_auc, pre.auc_ratio,
        pre.logloss, pre.oracle_logloss, post[0].auc_ratio if post else float("nan"), recovered, recover_ratio,
        last.auc_ratio, metrics.merged(rows).calibration, metrics.quantile_ms(fresh, 0.5),
        metrics.quantile_ms(fresh, 0.99), records / span if span else float("nan"), max(rates, default=0.0), killed,
        max((s["restarts"] for s in samples), default=0),
    )  # fmt: skip


def plots(out: Path, rows: np.ndarray, fresh: np.ndarray, samples: list[dict[str, Any]], drift_at: int,
          window: int) -> list[Path]:
    """AUC and oracle per window, lag, throughput and freshness as PNG files in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = metrics.figures(rows)
    t = [s["t"] for s in samples]
    paths = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = [(f.index + 0.5) * window for f in figs]
    ax.plot(x, [f.auc for f in figs], "o-", label="model (progressive)")
    ax.plot(x, [f.oracle_auc for f in figs], "s--", label="oracle")
    ax.axvline(drift_at, color="red", lw=1, label="drift")
    ax.set_xlabel("record id (window midpoint)")
    ax.set_ylabel("AUC")
    ax.legend(loc="lower right")
    save(fig, "auc.png")
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.plot(t, [s["lag"] for s in samples])
    ax.set_xlabel("seconds")
    ax.set_ylabel("lag (records)")
    save(fig, "lag.png")
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.plot(t, [s["records_per_second"] for s in samples], label="acked records/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("records/s")
    save(fig, "throughput.png")
    fig, ax = plt.subplots(figsize=(7, 2.6))
    edges = metrics.FRESH_EDGES_MS
    mids = np.sqrt(np.maximum(edges[:-1], 0.5) * edges[1:]) / 1000
    ax.bar(mids, fresh, width=np.diff(edges) / 1000, align="center")
    ax.set_xscale("log")
    used = np.flatnonzero(fresh)
    if len(used):
        ax.set_xlim(edges[max(used[0], 1)] / 1000 / 2, edges[used[-1] + 1] / 1000 * 2)
    ax.set_xlabel("event time to applied in the model (s)")
    ax.set_ylabel("records")
    save(fig, "freshness.png")
    return paths


def describe(s: Summary) -> list[tuple[str, str]]:
    """The report as (check, value) rows."""
    rec = f"{s.recovered_after:,} records" if s.recovered_after is not None else "not within the run"
    return [
        ("records produced", f"{s.records:,}"),
        ("records applied to the model (ledger)", f"{s.applied:,}"),
        ("duplicates / missing", f"{s.duplicates} / {s.missing}"),
        ("exactly once", "yes" if s.exact else "NO"),
        ("worker killed", s.killed or "none"),
        ("restarts", str(s.restarts)),
        (f"AUC before the drift (last {10_000:,} records before id {s.drift_at:,})",
         f"{s.before_auc:.4f} vs oracle {s.before_oracle_auc:.4f} = {s.before_ratio:.3f}"),
        ("log loss before the drift", f"{s.before_logloss:.4f} vs oracle {s.before_oracle_logloss:.4f}"),
        ("AUC/oracle in the first window after the drift", f"{s.dip_ratio:.3f}"),
        (f"back to >= {s.recover_ratio:.2f} x oracle after", rec),
        ("AUC/oracle at the end (last 2 windows)", f"{s.final_ratio:.3f}"),
        ("calibration (predicted / observed CTR)", f"{s.calibration:.3f}"),
        ("freshness p50 / p99 (event time to applied)",
         f"{s.fresh_p50_ms / 1000:.2f} s / {s.fresh_p99_ms / 1000:.2f} s"),
        ("throughput (applied, first to last)", f"{s.records_per_second:,.0f} records/s"),
        ("peak acked rate", f"{s.peak_records_per_second:,.0f} records/s"),
        *s.seam,
    ] + (served_rows(s.served) if s.served is not None else [])  # fmt: skip


def served_rows(served: Any) -> list[tuple[str, str]]:
    from examples.streaming_ctr.served import describe as describe_served

    return describe_served(served)


def write_html(out: Path, summary: Summary, images: list[Path]) -> Path:
    """``report.html``: the report's table and the plots embedded (base64), one self-contained file."""
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in describe(summary))
    imgs = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{p.stem}</figcaption></figure>" for p in images
    )  # fmt: skip
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>streamrover: streaming CTR report</title>"
        "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}td{padding:2px 12px}"
        "tr:nth-child(odd){background:#f4f4f4}</style></head><body>"
        f"<h1>streamrover: online CTR, exactly once</h1><table>{rows}</table>{imgs}"
        f"<script type='application/json' id='summary'>{json.dumps(asdict(summary))}</script></body></html>"
    )
    path = out / "report.html"
    path.write_text(page)
    return path
