"""The job's Prometheus metrics: a prometheus-client collector that reads the master's state at each scrape.

Counts are records, never position differences (ARCHITECTURE.md, Observability). Counters
(``*_total``) count since the master process started, as Prometheus counters do; Prometheus'
``rate()`` turns them into lease and ack rates. The ``*_per_second`` gauges are the master's
own rates over its last few seconds (the ones ``streamrover status`` prints).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from streamrover.sources.api import SourceKind
from streamrover.sources.staged import is_staged

if TYPE_CHECKING:
    from streamrover.shard_service.master.server import ShardServicer

PREFIX = "streamrover"
NODES_PREFIX = "nodes/"  # the agents' health documents: nodes/<run id>/<node id> (trainers.torch.agent)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


class JobCollector(Collector):
    """Everything the master knows about its job, as metric families (one consistent read under its lock)."""

    def __init__(self, servicer: ShardServicer, durability: str = "normal") -> None:
        self._servicer = servicer
        self._durability = durability

    def collect(self) -> Iterator[Metric]:
        """The metric families of this instant (called by the registry at each scrape)."""
        core = self._servicer.core
        lag = _gauge("partition_lag_records", "records available in the source and not yet applied (acked), per "
                     "partition", ["dataset", "partition"])  # fmt: skip
        ds_lag = _gauge("dataset_lag_records", "records available in a stream's source and not yet applied (acked)",
                        ["dataset"])  # fmt: skip
        shards = _gauge("shards", "shards per state (committed: folded into the committed cursor)",
                        ["dataset", "state"])  # fmt: skip
        records = _gauge("dataset_records", "records acked (applied, not yet in a durable checkpoint) or committed",
                         ["dataset", "state"])  # fmt: skip
        planned = _gauge("dataset_records_planned", "records planned into shards (batch: per epoch)", ["dataset"])
        dead = _gauge("dataset_dead_letters", "records that failed to decode (sent to the dead-letter dataset)",
                      ["dataset"])  # fmt: skip
        failed = _gauge("dataset_failed", "1 when the dataset cannot go on (see its error)", ["dataset"])
        lost = _gauge("dataset_lost_records", "records accounted as lost (deleted before they were trained; "
                      "sr.on_data_loss=skip)", ["dataset"])  # fmt: skip
        skew = _gauge("dataset_time_skew_ms", "stream time the leased shards span: the newest leased shard's "
                      "first record less the oldest shard not yet acked (at most sr.max_skew_ms)",
                      ["dataset"])  # fmt: skip
        gaps = _gauge("dataset_commit_gaps", "staged commits a later commit of the same producer and part names as "
                      "its previous, not arrived (skipped: past sr.commit_gap_ms with sr.on_data_loss=skip)",
                      ["dataset", "state"])  # fmt: skip
        gap_age = _gauge("commit_gap_age_seconds", "seconds since a staged commit gap opened (a missing commit)",
                         ["dataset", "producer", "part", "epoch", "state"])  # fmt: skip
        finished = _gauge("dataset_finished", "1 when a batch dataset has every shard of every epoch acked",
                          ["dataset"])  # fmt: skip
        workers = _gauge("workers", "workers joined and alive")
        w_leases = _gauge("worker_leases", "shards a worker holds", ["worker", "name"])
        w_records = _gauge("worker_records_acked", "records a worker acked since it joined", ["worker", "name"])
        w_seen = _gauge("worker_last_seen_seconds", "seconds since a worker's last call", ["worker", "name"])
        events = CounterMetricFamily(
            f"{PREFIX}_events",
            "since the master started: leases granted, worker joins, workers lost (declared dead: missed heartbeats)",
            labels=["event"],
        )
        acks = CounterMetricFamily(f"{PREFIX}_acks", "acks recorded since the master started")
        acked = CounterMetricFamily(f"{PREFIX}_records_acked", "records acked since the master started")
        with self._servicer.cond:
            now = core.clock()
            for name, ds in sorted(core.datasets.items()):
                counts = core.counts(ds)
                for state in ("todo", "leased", "acked", "committed"):
                    shards.add_metric([name, state], getattr(counts, state))
                records.add_metric([name, "acked"], counts.records_acked)
                records.add_metric([name, "committed"], counts.records_committed)
                planned.add_metric([name], ds.planned_records())
                dead.add_metric([name], ds.dead_letters)
                failed.add_metric([name], 1 if ds.failed else 0)
                lost.add_metric([name], core.streams.upstream.lost_records(ds))
                finished.add_metric([name], 1 if counts.finished else 0)
                open_gaps = core.staged.gaps.of(name)
                if open_gaps or is_staged(ds.spec.uri):
                    skipped = sum(1 for g in open_gaps if g.skipped)
                    gaps.add_metric([name, "open"], len(open_gaps) - skipped)
                    gaps.add_metric([name, "skipped"], skipped)
                for g in open_gaps:
                    labels = [name, g.producer, g.part, str(g.epoch), "skipped" if g.skipped else "open"]
                    gap_age.add_metric(labels, max(now - g.opened_at, 0.0))
                if ds.kind is SourceKind.STREAM:
                    total = 0
                    for plan, (_, _, part_lag) in zip(ds.partitions, core.lag(ds)):
                        lag.add_metric([name, plan.id], part_lag)
                        total += part_lag
                    ds_lag.add_metric([name], total)
                    skew.add_metric([name], core.stream_time.skew_ms(core, name))
            workers.add_metric([], len(core.workers))
            for wid, w in sorted(core.workers.items()):
                w_leases.add_metric([wid, w.name], len(w.leases))
                w_records.add_metric([wid, w.name], w.records_acked)
                w_seen.add_metric([wid, w.name], max(now - w.last_seen, 0.0))
            for event in ("leases_granted", "joins", "workers_lost"):
                events.add_metric([event], core.events[event])
            acks.add_metric([], core.ack_log.acks_total)
            acked.add_metric([], core.ack_log.records_total)
            rps, aps = core.rates()
            cut, cut_step = core.cut_book.last_committed_cut, None
            record = core.cuts.get(cut)
            if record is not None:
                cut_step = record.step
            persisting = core.cut_book.persisting()
            commit_error = core.cut_book.cut_commit_error
            commit_time = core.cut_book.last_commit_time
            uptime = now - core.started
            nodes = core.kv.scan(NODES_PREFIX)
        yield from (lag, ds_lag, skew, shards, records, planned, dead, failed, lost, gaps, gap_age, finished, workers,
                    w_leases, w_records, w_seen, events, acks, acked)  # fmt: skip
        yield GaugeMetricFamily(f"{PREFIX}_records_acked_per_second", "records acked per second, last few seconds",
                                value=rps)  # fmt: skip
        yield GaugeMetricFamily(f"{PREFIX}_acks_per_second", "acks per second, last few seconds", value=aps)
        yield _gauge_value("checkpoint_committed_cut", "the id of the last committed cut (its checkpoint is durable)",
                           cut)  # fmt: skip
        if cut_step is not None:
            yield _gauge_value("checkpoint_step", "the training step of the last durable checkpoint", cut_step)
        yield _gauge_value("checkpoint_persisting", "checkpoints being persisted (cuts prepared, not yet durable)",
                           persisting)  # fmt: skip
        yield _gauge_value("checkpoint_commit_refused", "1 when the last cut commit was refused (see status)",
                           1 if commit_error else 0)  # fmt: skip
        if commit_time:
            yield _gauge_value("checkpoint_last_commit_timestamp_seconds",
                               "when the last cut committed (unix time)", commit_time)  # fmt: skip
        journal = _gauge("journal_durability", "the journal's durability mode (1 for the mode in use)", ["mode"])
        journal.add_metric([self._durability], 1)
        yield journal
        yield _gauge_value("master_uptime_seconds", "seconds since this master process started", uptime)
        yield _gauge_value("worker_sessions", "worker session streams the master serves now (one per worker "
                           "client; past the limit a client uses the unary calls)",
                           self._servicer.sessions.open)  # fmt: skip
        yield from self._trainer_metrics()
        yield from _node_metrics(nodes, time.time())
        yield from self._pace_metrics()

    def _pace_metrics(self) -> Iterator[Metric]:
        """Per node: busy seconds per step, the ratio to the other nodes' median, the straggler verdict."""
        labels = ["node"]
        busy = _gauge("node_step_busy_seconds", "a node's slowest rank's busy seconds per step (running or "
                      "runnable: time outside collectives), newest report", labels)  # fmt: skip
        wall = _gauge("node_step_wall_seconds", "a node's wall seconds per step (the same on every rank in lockstep)",
                      labels)  # fmt: skip
        ratio = _gauge("node_pace_ratio", "a node's busy seconds per step over the other nodes' median", labels)
        beyond = _gauge("node_pace_beyond_seconds", "how long a node's pace ratio has stayed above the straggler "
                        "threshold", labels)  # fmt: skip
        flag = _gauge("node_straggler", "1 when a node's pace ratio stayed above the threshold for the window", labels)
        now = time.time()
        for pace in self._servicer.stragglers.paces():
            busy.add_metric([pace.node], pace.busy_per_step)
            wall.add_metric([pace.node], pace.wall_per_step)
            if pace.ratio is not None:
                ratio.add_metric([pace.node], pace.ratio)
            beyond.add_metric([pace.node], pace.beyond_seconds(now))
            flag.add_metric([pace.node], 1 if pace.straggler else 0)
        yield from (busy, wall, ratio, beyond, flag)

    def _trainer_metrics(self) -> Iterator[Metric]:
        values = _gauge("trainer_metric", "the newest value a trainer reported (session.report(auc=...))",
                        ["reporter", "name"])  # fmt: skip
        steps = _gauge("trainer_step", "the training step of a reporter's newest report", ["reporter"])
        ages = _gauge("trainer_report_age_seconds", "seconds since a reporter's newest report", ["reporter"])
        now = time.time()
        for reporter, series in sorted(self._servicer.reported.latest().items()):
            newest = max(series.values(), key=lambda p: p.time)
            for name, point in sorted(series.items()):
                values.add_metric([reporter, name], point.value)
            if newest.step is not None:
                steps.add_metric([reporter], newest.step)
            ages.add_metric([reporter], max(now - newest.time, 0.0))
        yield from (values, steps, ages)


def _node_metrics(docs: list[tuple[str, bytes]], now: float) -> Iterator[Metric]:
    """From the health documents the nodes' agents (dlrover-run) write to the KV store: their worker restarts."""
    labels = ["run", "node"]
    exits = _gauge("node_worker_exits", "worker processes of a node that exited and were restarted in place, or "
                   "the node failed (the agent's newest 50)", labels)  # fmt: skip
    left = _gauge("node_restarts_left", "in-place worker restarts a node has left (dlrover-run --max-restarts)", labels)
    alive = _gauge("node_workers", "worker processes a node runs now", labels)
    age = _gauge("node_heartbeat_age_seconds", "seconds since a node's agent last wrote its health", labels)
    check = _gauge("node_check_compute_seconds", "the node check's compute probe (matmuls), in seconds", labels)
    check_ratio = _gauge("node_check_ratio", "the node check's compute probe over the other nodes' median", labels)
    check_ok = _gauge("node_check_passed", "1 when the node passed its pre-flight check, 0 when it failed", labels)
    check_cost = _gauge("node_check_cost_seconds", "what the node check cost the node (waits included)", labels)
    hangs = _gauge("node_hangs", "hung worker groups the node's agent killed and restarted (--hang-timeout)", labels)
    for key, value in docs:
        run, _, node = key[len(NODES_PREFIX):].partition("/")
        try:
            doc = json.loads(value)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # the KV store holds opaque bytes: only well-formed health documents count
        if not node or not isinstance(doc, dict):
            continue
        exits.add_metric([run, node], len(doc.get("exits") or []))
        if isinstance(doc.get("restarts_left"), int):
            left.add_metric([run, node], doc["restarts_left"])
        alive.add_metric([run, node], len(doc.get("workers") or {}))
        beat = doc.get("heartbeat_at") or doc.get("at")
        if isinstance(beat, (int, float)):
            age.add_metric([run, node], max(now - beat, 0.0))
        checked = doc.get("node_check")
        if isinstance(checked, dict):
            probes = ((check, "compute_s"), (check_ratio, "ratio"), (check_cost, "cost_s"), (check_ok, "passed"))
            for gauge, name in probes:
                found = checked.get(name)
                if isinstance(found, (int, float)):
                    gauge.add_metric([run, node], float(found))
        hangs.add_metric([run, node], len(doc.get("hangs") or []))
    yield from (exits, left, alive, age, check, check_ratio, check_ok, check_cost, hangs)


def _gauge_value(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def job_registry(servicer: ShardServicer, durability: str = "normal") -> CollectorRegistry:
    """A registry of its own (no process-wide default registry) holding the job's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(servicer, durability))
    return registry


__all__ = ["JobCollector", "job_registry"]
