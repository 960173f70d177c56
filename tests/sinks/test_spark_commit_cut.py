"""The Spark sink's commit, its connection to the master reset mid-call, is retried and lands exactly once.

A real local Spark session writes each micro-batch as Parquet (``SparkTrainingSink``, called as
``foreachBatch`` calls it) and commits it to a real master through :class:`tests.netcut.CutProxy`. The
proxy resets the connection as the CommitStaged answer passes (the master committed, the sink never heard)
or as its request passes (the master never saw it). The retry lands once: the dataset holds every batch's
records once, a lost answer's retry is answered already_committed, and the replayed batch's second copy is
collected (the sink's commits are settled: Spark runs its batches in order).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.shard_service import ShardClient
from streamrover.sinks.spark import training_sink
from streamrover.testing.procs import MasterProcess
from tests.netcut import CutProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def spark() -> Iterator[object]:
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[1]")
        .appName("commit-cut")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
        .config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .getOrCreate()
    )
    yield session
    session.stop()


def test_spark_sink_commit_cut_mid_call_lands_once(tmp_path: Path, master: MasterProcess, spark: object) -> None:
    proxy = CutProxy(master.address)
    sink = training_sink(proxy.address, "clicks", staging_dir=str(tmp_path / "staging"), token=master.token,
                         producer="query-1")  # fmt: skip
    direct = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    try:
        batch = lambda lo, hi: spark.range(lo, hi).selectExpr("id", "id * 0.5 AS x")  # type: ignore[attr-defined]  # noqa: E731
        sink(batch(0, 100), 0)  # registers the dataset, commits batch 0
        retries = sink.client._transport.retries

        cut = proxy.arm("answer")  # batch 1 is committed, its answer lost: the retry is answered already
        sink(batch(100, 250), 1)
        assert cut.is_set() and sink.client._transport.retries > retries
        assert sink.history[-1] == (1, 150, True)

        cut = proxy.arm("request")  # batch 2's commit never reaches the master: the retry commits it
        sink(batch(250, 300), 2)
        assert cut.is_set() and sink.history[-1] == (2, 50, False)

        sink(batch(100, 250), 1)  # Spark replays batch 1 (restarted before it recorded it): nothing added
        assert sink.history[-1] == (1, 150, True)
        assert direct.describe_dataset("clicks").total_records == 300
        ids = []
        for shard in direct.shards("clicks", wait=0.2):
            ids += [i for b in shard.batches() for i in b.records.column("id").to_pylist()]
            shard.ack(wait=True)
            if len(ids) >= 300:
                break
        assert sorted(ids) == list(range(300)), "each record committed exactly once"
        copies = {p.parent.name for p in (tmp_path / "staging" / "query-1" / "driver" / "1").rglob("*.parquet")}
        assert len(copies) == 1, f"the replay's second copy of batch 1 was not collected: {copies}"
    finally:
        sink.close()
        direct.close()
        proxy.close()
