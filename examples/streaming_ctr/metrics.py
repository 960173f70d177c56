"""Progressive-validation figures from mergeable histograms: windowed AUC, log loss, calibration, freshness.

A window (``window`` consecutive record ids) keeps, for the model and for the oracle, counts of
positives and negatives per logit bin plus a few sums (:data:`SUMS`). Everything is additive,
so the trainer can keep it as a tensor inside the model's state (restored with the model, hence
counted exactly once), and the report can merge windows. AUC from :data:`BINS` logit bins
(width 0.03 on [-8, 4]) counts a tie inside one bin as half: its error is below 1e-3 here.

Freshness (event time to applied-in-model) is a histogram over log-spaced millisecond bins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BINS = 400
LOGIT_LO, LOGIT_HI = -8.0, 4.0
SUMS = ("n", "clicks", "pred_sum", "oracle_sum", "logloss", "oracle_logloss", "event_ms_sum", "applied_ms_sum")
# one window row: model pos/neg, oracle pos/neg histograms, then the sums
ROW = 4 * BINS + len(SUMS)
FRESH_EDGES_MS = np.concatenate([[0.0], np.logspace(0, 6, 121)])  # 1 ms .. 1000 s; the last bin takes the rest


def _bin(logits: np.ndarray) -> np.ndarray:
    scaled = (np.clip(logits, LOGIT_LO, LOGIT_HI - 1e-9) - LOGIT_LO) / (LOGIT_HI - LOGIT_LO) * BINS
    return scaled.astype(np.int64)


def _logloss(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    # -[y log s(z) + (1-y) log(1-s(z))] = softplus(z) - y z
    return np.logaddexp(0.0, logits) - y * logits


def window_rows(window: np.ndarray, logits: np.ndarray, oracle: np.ndarray, y: np.ndarray,
                event_ms: np.ndarray, applied_ms: float, n_windows: int) -> np.ndarray:
    """The additive update of ``n_windows`` window rows by one step's records (``window`` = their row)."""
    rows = np.zeros((n_windows, ROW))
    w = np.clip(window, 0, n_windows - 1)
    pos = y > 0.5
    for k, (vals, sel) in enumerate(((logits, pos), (logits, ~pos), (oracle, pos), (oracle, ~pos))):
        np.add.at(rows, (w[sel], k * BINS + _bin(vals[sel])), 1.0)
    sums = np.stack([np.ones_like(y), y, 1 / (1 + np.exp(-logits)), 1 / (1 + np.exp(-oracle)), _logloss(logits, y),
                     _logloss(oracle, y), event_ms, np.full_like(y, applied_ms)], axis=1)  # fmt: skip
    for j in range(len(SUMS)):
        np.add.at(rows, (w, 4 * BINS + j), sums[:, j])
    return rows


def freshness_counts(event_ms: np.ndarray, applied_ms: float) -> np.ndarray:
    """Counts of records per freshness bin (:data:`FRESH_EDGES_MS`)."""
    lag = np.maximum(applied_ms - event_ms, 0.0)
    idx = np.clip(np.searchsorted(FRESH_EDGES_MS, lag, side="right") - 1, 0, len(FRESH_EDGES_MS) - 2)
    return np.bincount(idx, minlength=len(FRESH_EDGES_MS) - 1).astype(np.float64)


def auc_from_hist(pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC of scores binned into ordered bins (ties within a bin count half); nan without both classes."""
    p, n = pos.sum(), neg.sum()
    if p == 0 or n == 0:
        return float("nan")
    below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])
    return float(np.sum(pos * (below + 0.5 * neg)) / (p * n))


@dataclass(frozen=True)
class WindowFigures:
    """One window's figures: the model's progressive ones and the oracle's."""

    index: int
    records: int
    auc: float
    oracle_auc: float
    logloss: float
    oracle_logloss: float
    calibration: float  # predicted / observed CTR
    ctr: float
    event_s: float  # mean event time (epoch seconds)
    applied_s: float  # mean applied time

    @property
    def auc_ratio(self) -> float:
        return self.auc / self.oracle_auc if self.oracle_auc == self.oracle_auc and self.oracle_auc else float("nan")


def figures(rows: np.ndarray, min_records: int = 1) -> list[WindowFigures]:
    """The figures of every window with at least ``min_records`` records."""
    out = []
    for i, row in enumerate(np.asarray(rows, dtype=np.float64)):
        s = dict(zip(SUMS, row[4 * BINS:]))
        n = s["n"]
        if n < min_records:
            continue
        h = [row[k * BINS:(k + 1) * BINS] for k in range(4)]
        out.append(WindowFigures(
            i, int(n), auc_from_hist(h[0], h[1]), auc_from_hist(h[2], h[3]), s["logloss"] / n,
            s["oracle_logloss"] / n, s["pred_sum"] / max(s["clicks"], 1e-9), s["clicks"] / n,
            s["event_ms_sum"] / n / 1000, s["applied_ms_sum"] / n / 1000,
        ))  # fmt: skip
    return out


def merged(rows: np.ndarray) -> WindowFigures:
    """The figures of several window rows taken together."""
    (fig,) = figures(np.asarray(rows).sum(axis=0, keepdims=True)) or [None]
    assert fig is not None, "no records in these windows"
    return fig


def quantile_ms(counts: np.ndarray, q: float) -> float:
    """The ``q`` quantile of a freshness histogram, in ms (geometric interpolation inside a bin)."""
    total = counts.sum()
    if total == 0:
        return float("nan")
    cum = np.cumsum(counts)
    i = int(np.searchsorted(cum, q * total))
    lo, hi = FRESH_EDGES_MS[i], FRESH_EDGES_MS[i + 1]
    before = cum[i - 1] if i else 0.0
    frac = (q * total - before) / max(counts[i], 1e-12)
    return float(lo + (hi - lo) * frac) if lo == 0 else float(lo * (hi / lo) ** frac)
