"""A seeded click stream whose ground truth is known: a hidden model with feature interactions and drift.

Every impression ``id`` (0, 1, 2, ...) has a user, an ad, a context (site x device), three
hashed categorical fields (publisher, ad category, hour slot), two numeric fields and an event
time. Its click probability comes from :class:`HiddenModel`: per-field weights, two factorised
interactions (user x ad, ad x context), a numeric x ad interaction and a numeric slope. The
categorical values a record carries are 40-bit hashes of the underlying index, as a real
feature pipeline would send them; a model must hash them into its own tables.

**Concept drift** is scheduled by record id: from ``drift_at[k]`` on, regime ``k + 1`` holds, in
which the ads' weights and interaction vectors are drawn anew (popular ads fall out of favour,
others rise). Since the probability of every record is known, the best achievable ("oracle")
AUC and log loss of any window are computable (:func:`oracle_logit`).

Everything is a pure function of ``(seed, id)``: records are generated in blocks of
:data:`BLOCK` ids, each from its own seeded generator, so any range can be regenerated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK = 1024
USERS, ADS, CONTEXTS, PUBLISHERS, CATEGORIES, HOURS = 500, 120, 12, 100, 40, 24
CATEGORICAL = ("user", "ad", "context", "publisher", "category", "hour")
NUMERIC = ("n_quality", "n_recency")
# The record's JSON fields and their types, as the master's ``sr.schema`` option takes them.
SCHEMA = ",".join([f"{c}:int64" for c in ("id", *CATEGORICAL)] + [f"{n}:float64" for n in NUMERIC]
                  + ["event_ms:int64", "clicked:int64"])  # fmt: skip


def _hashes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1 << 20, 1 << 40, n, dtype=np.int64)


@dataclass(frozen=True)
class Regime:
    """The ad-dependent part of the hidden model (what drifts)."""

    w_ad: np.ndarray
    v_ad: np.ndarray  # user x ad factors
    u_ad: np.ndarray  # ad x context factors
    q_ad: np.ndarray  # how strongly n_quality moves each ad's click rate


class HiddenModel:
    """The true click model of one seed. ``regimes[k]`` holds from ``drift_at[k-1]`` on."""

    def __init__(self, seed: int, drift_at: tuple[int, ...] = (), dim: int = 4, bias: float = -2.0) -> None:
        self.seed, self.drift_at, self.bias = seed, tuple(drift_at), bias
        rng = np.random.default_rng([seed, 0])
        sizes = (USERS, ADS, CONTEXTS, PUBLISHERS, CATEGORIES, HOURS)
        # the hash a record carries for each index of each field
        self.codes = {name: _hashes(rng, n) for name, n in zip(CATEGORICAL, sizes)}
        self.w_user = rng.normal(0, 0.1, USERS)
        self.v_user = rng.normal(0, 0.15, (USERS, dim))
        self.w_ctx = rng.normal(0, 0.8, CONTEXTS)
        self.u_ctx = rng.normal(0, 0.5, (CONTEXTS, dim))
        self.w_pub = rng.normal(0, 0.3, PUBLISHERS)
        self.w_cat = rng.normal(0, 0.4, CATEGORIES)
        self.w_hour = 0.4 * np.sin(np.arange(HOURS) / HOURS * 2 * np.pi)
        self.ad_category = rng.integers(0, CATEGORIES, ADS)
        self.ad_popularity = rng.dirichlet(np.full(ADS, 2.0))
        self.regimes = []
        for r in range(len(self.drift_at) + 1):
            g = np.random.default_rng([seed, 1, r])
            self.regimes.append(Regime(g.normal(0, 1.3, ADS), g.normal(0, 0.5, (ADS, dim)),
                                       g.normal(0, 0.5, (ADS, dim)), g.normal(0, 0.2, ADS)))  # fmt: skip

    def regime_of(self, ids: np.ndarray) -> np.ndarray:
        """The regime index of each record id."""
        return np.searchsorted(np.asarray(self.drift_at, dtype=np.int64), ids, side="right")

    def logit_of(self, idx: dict[str, np.ndarray], nums: dict[str, np.ndarray], regime: np.ndarray) -> np.ndarray:
        """The true log-odds of a click, from the underlying indexes (not the hashes)."""
        u, a, c = idx["user"], idx["ad"], idx["context"]
        w_ad = np.empty(len(a))
        inter = np.empty(len(a))
        q = np.empty(len(a))
        for r in np.unique(regime):
            m = regime == r
            reg = self.regimes[int(r)]
            w_ad[m] = reg.w_ad[a[m]]
            inter[m] = (np.sum(self.v_user[u[m]] * reg.v_ad[a[m]], axis=1)
                        + np.sum(self.u_ctx[c[m]] * reg.u_ad[a[m]], axis=1))  # fmt: skip
            q[m] = reg.q_ad[a[m]]
        return (self.bias + self.w_user[u] + w_ad + self.w_ctx[c] + self.w_pub[idx["publisher"]]
                + self.w_cat[idx["category"]] + self.w_hour[idx["hour"]] + inter
                + q * nums["n_quality"] + 0.5 * (nums["n_recency"] - 0.5))  # fmt: skip


class ClickStream:
    """Records ``[start, stop)`` of one seed, as columns (numpy) or JSON lines; see the module docstring."""

    def __init__(self, seed: int = 7, drift_at: tuple[int, ...] = ()) -> None:
        self.hidden = HiddenModel(seed, tuple(drift_at))
        self.seed = seed
        self._index: dict[str, dict[int, int]] | None = None

    def _block(self, b: int) -> dict[str, np.ndarray]:
        h = self.hidden
        rng = np.random.default_rng([self.seed, 2, b])
        n = BLOCK
        idx = {
            "user": rng.integers(0, USERS, n),
            "ad": rng.choice(ADS, n, p=h.ad_popularity),
            "context": rng.integers(0, CONTEXTS, n),
            "publisher": rng.integers(0, PUBLISHERS, n),
            "hour": rng.integers(0, HOURS, n),
        }
        idx["category"] = h.ad_category[idx["ad"]]
        nums = {"n_quality": rng.normal(0, 1, n), "n_recency": rng.random(n)}
        ids = np.arange(b * n, (b + 1) * n, dtype=np.int64)
        logit = h.logit_of(idx, nums, h.regime_of(ids))
        clicked = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
        out = {"id": ids, **{k: h.codes[k][v] for k, v in idx.items()}, **nums,
               "clicked": clicked, "true_logit": logit}  # fmt: skip
        return out

    def columns(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Records with ids in ``[start, stop)`` (plus ``true_logit``, which a record never carries)."""
        blocks = [self._block(b) for b in range(start // BLOCK, (stop - 1) // BLOCK + 1)] if stop > start else []
        if not blocks:
            return {k: np.empty(0) for k in ("id", *CATEGORICAL, *NUMERIC, "clicked", "true_logit")}
        cols = {k: np.concatenate([blk[k] for blk in blocks]) for k in blocks[0]}
        lo = start - (start // BLOCK) * BLOCK
        return {k: v[lo: lo + stop - start] for k, v in cols.items()}

    def json_records(self, cols: dict[str, np.ndarray], event_ms: np.ndarray) -> list[bytes]:
        """The records as the producer sends them: JSON objects with the event time, no ground truth."""
        names = ("id", *CATEGORICAL)
        ints = {k: cols[k].tolist() for k in (*names, "clicked")}
        floats = {k: np.round(cols[k], 5).tolist() for k in NUMERIC}
        times = event_ms.tolist()
        out = []
        for i in range(len(times)):
            rec: dict[str, Any] = {k: ints[k][i] for k in names}
            rec.update({k: floats[k][i] for k in NUMERIC})
            rec["event_ms"] = times[i]
            rec["clicked"] = ints["clicked"][i]
            out.append(json.dumps(rec, separators=(",", ":")).encode())
        return out

    def partition_of(self, users: np.ndarray, partitions: int) -> np.ndarray:
        """Each record's partition from its user's hash: the user's index modulo ``partitions``.

        Users are drawn uniformly, so every partition carries the same share of the traffic (a hash
        of 500 users would leave them a few percent apart, and a partition that holds more records
        falls behind in event time when every worker reads its own at the same rate).
        """
        index = self._indexes()["user"]
        return np.fromiter((index[int(u)] % partitions for u in users), np.int64, len(users))

    def _indexes(self) -> dict[str, dict[int, int]]:
        if self._index is None:
            self._index = {k: {int(c): i for i, c in enumerate(v)} for k, v in self.hidden.codes.items()}
        return self._index

    def oracle_logit(self, cols: dict[str, Any]) -> np.ndarray:
        """The true log-odds of records as a trainer receives them (hashed fields, numerics, ids)."""
        index = self._indexes()
        idx = {k: np.fromiter((index[k][int(c)] for c in np.asarray(cols[k])), np.int64) for k in CATEGORICAL}
        nums = {k: np.asarray(cols[k], dtype=np.float64) for k in NUMERIC}
        ids = np.asarray(cols["id"], dtype=np.int64)
        return self.hidden.logit_of(idx, nums, self.hidden.regime_of(ids))
