"""The master's HTTP endpoint (issue 13, item 4): Prometheus ``/metrics`` of a running stream job, the token."""

from __future__ import annotations

import math

import pytest

from streamrover.shard_service import InvalidArgumentError
from streamrover.testing.procs import MasterProcess
from tests.brokers.tansu import TansuBroker
from tests.helpers import wait_until
from tests.shard_service.dashboard_job import http_status, start_stream_job


def test_metrics_of_a_running_stream_job(tansu_broker: TansuBroker, master: MasterProcess) -> None:
    job = start_stream_job(tansu_broker, master, (50, 30))
    cut = job.commit()
    job.worker.report({"auc": 0.8125, "loss": 0.4375}, step=12)
    m = job.scrape()
    ds = (("dataset", "clicks"),)
    assert m[("streamrover_dataset_records", (*ds, ("state", "committed")))] == 80
    assert m[("streamrover_dataset_lag_records", ds)] == 0
    for p in (0, 1):
        assert job.lag(p) == 0, "everything produced is committed"
    assert m[("streamrover_shards", (*ds, ("state", "committed")))] == 3 + 2  # 50 = 20+20+10, 30 = 20+10
    assert m[("streamrover_workers", ())] == 1
    assert m[("streamrover_checkpoint_committed_cut", ())] == cut
    assert m[("streamrover_records_acked_total", ())] == 80
    assert m[("streamrover_events_total", (("event", "leases_granted"),))] == 5
    assert m[("streamrover_trainer_metric", (("name", "auc"), ("reporter", "rank0@test")))] == 0.8125
    assert m[("streamrover_trainer_metric", (("name", "loss"), ("reporter", "rank0@test")))] == 0.4375
    assert m[("streamrover_trainer_step", (("reporter", "rank0@test"),))] == 12

    job.produce((7, 3))  # lag is counted in records, per partition, and follows the broker
    wait_until(lambda: (job.lag(0), job.lag(1)) == (7, 3), 30, "the lag of the new records on /metrics")
    job.worker.report({"auc": float("nan")})  # a diverged trainer's NaN is shown, not refused
    assert math.isnan(job.scrape()[("streamrover_trainer_metric", (("name", "auc"), ("reporter", "rank0@test")))])
    job.worker.close()


def test_the_token_is_required(master: MasterProcess) -> None:
    url = master.dashboard_url
    assert url.startswith("http://127.0.0.1:"), "bound to the loopback interface by default"
    for path in ("metrics", "api/v1/metrics"):
        assert http_status(url + path) == 401, f"/{path} without a token"
        assert http_status(url + path, token="wrong") == 401, f"/{path} with a wrong token"
        assert http_status(url + path, token=master.token) == 200
    assert http_status(url) == 200, "the page itself is static (it asks for the token)"
    assert http_status(url + "healthz") == 200
    assert http_status(url + "nothing-here", token=master.token) == 404
    assert http_status(url + "metrics", token=master.token, method="POST") == 405
    assert master.token not in master.log_tail(1000), "the token must never be logged"


def test_node_restarts_from_the_agents_health_documents(master: MasterProcess) -> None:
    from types import SimpleNamespace

    from streamrover.shard_service import ShardClient
    from streamrover.trainers.torch.agent import HealthReporter
    from tests.shard_service.dashboard_job import scrape

    with ShardClient(master.address, token=master.token, heartbeat=False) as client:
        health = HealthReporter(client, "run-7", "node-0")  # what dlrover-run's agent writes to the KV store
        exits = {0: SimpleNamespace(pid=4242, exitcode=-9), 1: SimpleNamespace(pid=4243, exitcode=1)}
        health.node_check = {"compute_s": 0.25, "ratio": 1.25, "cost_s": 3.5, "passed": True}
        health.hangs = [{"at": 1.0, "stuck": {"0": 31.0}}]
        health.report("HEALTHY", restarts_left=1, round_=2, failures=exits, pids={0: 5001, 1: 5002})
        client.kv_set("nodes/run-7/garbage", b"\xff not json", 0)  # opaque bytes under the prefix are skipped
        m = scrape(master)
    node = (("node", "node-0"), ("run", "run-7"))
    assert m[("streamrover_node_worker_exits", node)] == 2
    assert m[("streamrover_node_restarts_left", node)] == 1
    assert m[("streamrover_node_workers", node)] == 2
    assert m[("streamrover_node_heartbeat_age_seconds", node)] >= 0
    assert m[("streamrover_node_check_compute_seconds", node)] == 0.25
    assert m[("streamrover_node_check_ratio", node)] == 1.25
    assert m[("streamrover_node_check_cost_seconds", node)] == 3.5
    assert m[("streamrover_node_check_passed", node)] == 1
    assert m[("streamrover_node_hangs", node)] == 1
    assert not any(labels == (("node", "garbage"), ("run", "run-7")) for _, labels in m)


def test_report_refuses_bad_names(master: MasterProcess) -> None:
    from streamrover.shard_service import ShardClient

    with ShardClient(master.address, token=master.token, heartbeat=False) as client:
        with pytest.raises(InvalidArgumentError, match="metric name 'bad-name' must match"):
            client.report({"bad-name": 1.0})
        with pytest.raises(InvalidArgumentError, match="no values given"):
            client.report({})
        with pytest.raises(InvalidArgumentError, match="reporter 'a b' must match"):
            client.report({"auc": 0.5}, reporter="a b")


def test_node_pace_from_the_ranks_reports(master: MasterProcess) -> None:
    """Ranks report busy seconds per step (StepPace); the master compares each node with the others' median."""
    from streamrover.shard_service import ShardClient
    from tests.shard_service.dashboard_job import scrape

    with ShardClient(master.address, token=master.token, heartbeat=False) as client:
        for node, busy in (("a", 0.010), ("b", 0.012), ("c", 0.050)):
            client.report({"step_busy_s": busy, "step_wall_s": 0.2, "steps": 10.0}, step=5, reporter=f"rank0@{node}")
        paces = {p.node: p for p in client.status().node_paces}
        m = scrape(master)
    assert sorted(paces) == ["a", "b", "c"]
    assert paces["c"].ratio == pytest.approx(0.050 / 0.011) and paces["c"].median_others == pytest.approx(0.011)
    assert not paces["c"].straggler, "beyond the threshold, but not yet for the window (30 s by default)"
    assert paces["c"].threshold == 2.0 and paces["c"].window_seconds == 30.0
    assert m[("streamrover_node_step_busy_seconds", (("node", "c"),))] == 0.050
    assert m[("streamrover_node_pace_ratio", (("node", "a"),))] == pytest.approx(0.010 / 0.031)
    assert m[("streamrover_node_straggler", (("node", "c"),))] == 0
    assert m[("streamrover_node_pace_beyond_seconds", (("node", "c"),))] >= 0
