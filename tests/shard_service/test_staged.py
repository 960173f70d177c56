"""Staged datasets: CommitStaged registers a sink's Parquet files as shards, once per (producer, part, epoch)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.cursor import DataCursor
from streamrover.shard_service import (
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ShardClient,
    UnauthenticatedError,
)
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.staged import encode_schema
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset

SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float32())])


def stage(path: Path, ids: range) -> tuple[str, int]:
    """A staged file of the records ``ids``; returns (its uri, its records)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(ids), "x": [float(i) / 2 for i in ids]}, schema=SCHEMA)
    pq.write_table(table, path, row_group_size=7)
    return str(path), len(ids)


@pytest.fixture
def client(master: MasterProcess) -> Iterator[ShardClient]:
    c = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    yield c
    c.close()


@pytest.fixture
def staging(tmp_path: Path, client: ShardClient) -> Path:
    root = tmp_path / "staging"
    options = {"sr.staging_dir": str(root), "sr.schema": encode_schema(SCHEMA)}
    client.register_dataset(DatasetSpec("clicks", "staged://clicks", "parquet", options, records_per_shard=10))
    return root


def read_all(client: ShardClient, dataset: str, ack: bool = True) -> list[int]:
    """Lease every shard there is now, read its ids, ack it."""
    ids: list[int] = []
    while True:
        _, leased = client.lease(dataset, max_shards=4, wait=0)
        if not leased:
            return ids
        for shard in leased:
            for batch in shard.batches():
                ids.extend(batch.records.column("id").to_pylist())
            if ack:
                shard.ack(wait=True)


def info(client: ShardClient, name: str = "clicks") -> pb.DatasetInfo:
    return client.describe_dataset(name)


def test_commit_makes_leasable_shards_once_per_key(client: ShardClient, staging: Path) -> None:
    a = stage(staging / "q1" / "driver" / "0" / "a.parquet", range(0, 25))
    b = stage(staging / "q1" / "driver" / "0" / "b.parquet", range(25, 30))
    first = client.commit_staged("clicks", "q1", "driver", 0, [a, b])
    assert (first.already_committed, first.records) == (False, 30)
    d = info(client)
    assert d.total_records == 30 and d.shards.todo == 4 and d.lag == 30  # committed, not trained: lag
    assert [p.id for p in d.partitions] == [a[0], b[0]]

    c = stage(staging / "q1" / "driver" / "0" / "c.parquet", range(30, 40))  # a replayed batch's new copy
    again = client.commit_staged("clicks", "q1", "driver", 0, [c], settled=True)  # Spark: batches in order
    assert (again.already_committed, again.records) == (True, 30), "a replayed key must add nothing"
    assert info(client).total_records == 30
    assert not Path(c[0]).exists(), "the replay's staging must be collected"

    assert sorted(read_all(client, "clicks")) == list(range(30))
    assert info(client).lag == 0, "acked (applied) records are not lag, committed or not (issue 28)"
    client.commit_cut(client.prepare_cut()[0])
    assert info(client).lag == 0 and info(client).records_committed == 30

    empty = client.commit_staged("clicks", "q1", "driver", 1, [])  # an empty batch: its key is committed
    assert (empty.already_committed, empty.records) == (False, 0)
    assert client.commit_staged("clicks", "q1", "driver", 1, []).already_committed


def test_uncommitted_staging_of_earlier_epochs_is_collected_once_settled(client: ShardClient, staging: Path) -> None:
    base = staging / "job" / "3"
    lost_attempt = stage(base / "4" / "attempt-1.parquet", range(0, 5))  # staged for epoch 4, never committed
    mine = stage(base / "5" / "ok.parquet", range(0, 5))
    stray = stage(base / "5" / "failed-attempt.parquet", range(5, 9))
    later = stage(base / "6" / "next.parquet", range(9, 12))  # the next checkpoint, being staged now
    other = stage(staging / "job" / "4" / "2" / "x.parquet", range(12, 13))  # another subtask's
    client.commit_staged("clicks", "job", "3", 5, [mine], settled=True)
    assert Path(mine[0]).exists(), "committed files stay (workers read them)"
    assert not Path(lost_attempt[0]).exists() and not Path(stray[0]).exists()
    assert Path(later[0]).exists() and Path(other[0]).exists(), "later epochs and other parts are not touched"
    client.commit_staged("clicks", "job", "3", 6, [later], settled=True)
    assert Path(mine[0]).exists() and Path(later[0]).exists(), "earlier commits' files are kept"


def test_an_earlier_epochs_staging_outlives_a_later_commit_unless_settled(client: ShardClient, staging: Path) -> None:
    """Flink may retry checkpoint 4's commit after checkpoint 5's landed (or replay it from a restore): a commit
    that is not settled collects nothing, and 4's commit then lands whole (the rows lost before: issue 26)."""
    base = staging / "job" / "3"
    pending = stage(base / "4" / "part-0.parquet", range(0, 5))  # checkpoint 4: its commit failed, to be retried
    mine = stage(base / "5" / "ok.parquet", range(5, 9))
    client.commit_staged("clicks", "job", "3", 5, [mine])
    assert Path(pending[0]).exists(), "checkpoint 4's files were collected while its commit could still come"
    late = client.commit_staged("clicks", "job", "3", 4, [pending])
    assert (late.already_committed, late.records) == (False, 5)
    assert sorted(read_all(client, "clicks")) == list(range(9))


def test_trained_files_are_deleted_once_no_restore_can_need_them(client: ShardClient, staging: Path) -> None:
    a = stage(staging / "job" / "0" / "1" / "a.parquet", range(0, 20))
    b = stage(staging / "job" / "1" / "1" / "b.parquet", range(20, 30))
    client.commit_staged("clicks", "job", "0", 1, [a])
    client.commit_staged("clicks", "job", "1", 1, [b])
    _, leased = client.lease("clicks", max_shards=4, wait=0)
    for shard in leased:
        if shard.lease.partition.id == a[0]:  # b's shard stays leased, not acked
            list(shard.batches())
            shard.ack(wait=True)
    client.commit_cut(client.prepare_cut()[0])
    assert Path(a[0]).exists(), "one durable checkpoint holds a: a fallback to the one before it needs a"
    client.commit_cut(client.prepare_cut()[0])
    assert not Path(a[0]).exists(), "two durable checkpoints hold every record of a: no restore needs it"
    assert not (staging / "job" / "0" / "1").exists(), "its emptied epoch folder goes with it"
    assert Path(b[0]).exists(), "b is not trained"
    assert info(client).records_committed == 20

    keep = {"sr.staging_dir": str(staging), "sr.schema": encode_schema(SCHEMA), "sr.staged_retention": "keep"}
    client.register_dataset(DatasetSpec("kept", "staged://kept", "parquet", keep, records_per_shard=10))
    k = stage(staging / "kq" / "driver" / "0" / "k.parquet", range(0, 10))
    client.commit_staged("kept", "kq", "driver", 0, [k])
    assert sorted(read_all(client, "kept")) == list(range(10))
    client.commit_cut(client.prepare_cut()[0])
    client.commit_cut(client.prepare_cut()[0])
    assert Path(k[0]).exists(), "sr.staged_retention=keep keeps trained files"
    bad = dict(keep, **{"sr.staged_retention": "forever"})
    with pytest.raises(InvalidArgumentError, match="sr.staged_retention must be delete or keep, not 'forever'"):
        client.register_dataset(DatasetSpec("bad", "staged://bad", "parquet", bad))


def test_bad_commits_get_precise_statuses_and_change_nothing(
    tmp_path: Path, client: ShardClient, staging: Path, master: MasterProcess
) -> None:
    good = stage(staging / "p" / "0" / "1" / "good.parquet", range(0, 10))
    with pytest.raises(NotFoundError, match="'nope' is not registered"):
        client.commit_staged("nope", "p", "0", 1, [good])
    write_parquet_dataset(tmp_path / "files", 10, files=1, row_group_size=10)
    client.register_dataset(DatasetSpec("batch", str(tmp_path / "files")))
    with pytest.raises(FailedPreconditionError, match="'batch' is not a staged dataset"):
        client.commit_staged("batch", "p", "0", 1, [good])

    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"id": ["a", "b"]}), wrong)
    cases = [
        ([(str(tmp_path / "missing.parquet"), 3)], "missing.parquet' does not exist"),
        ([(str(tmp_path / "junk.parquet"), 3)], "junk.parquet' is not a readable Parquet file"),
        ([(good[0], 11)], "holds 10 records, the commit says 11"),
        ([(str(wrong), 2)], "wrong.parquet' has schema"),
        ([good, good], "is named twice"),
        ([good, (str(tmp_path / "missing.parquet"), 3)], "missing.parquet"),  # one bad file: none is committed
    ]
    for files, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            client.commit_staged("clicks", "p", "0", 1, files)
    with pytest.raises(InvalidArgumentError, match="producer '../x'"):
        client.commit_staged("clicks", "../x", "0", 1, [good])
    with pytest.raises(InvalidArgumentError, match="epoch must be >= 0"):
        client.commit_staged("clicks", "p", "0", -1, [good])
    assert info(client).total_records == 0 and not info(client).partitions
    done = client.commit_staged("clicks", "p", "0", 1, [good])  # the key was never committed by the failures
    assert (done.already_committed, done.records) == (False, 10)
    with pytest.raises(InvalidArgumentError, match="already committed to dataset 'clicks'"):
        client.commit_staged("clicks", "p", "0", 2, [good])
    with pytest.raises(UnauthenticatedError):
        ShardClient(master.address, token="wrong", heartbeat=False).commit_staged("clicks", "p", "0", 3, [])


def test_commits_survive_a_master_sigkill_and_restore_requeues(
    client: ShardClient, staging: Path, master: MasterProcess
) -> None:
    a = stage(staging / "q" / "driver" / "7" / "a.parquet", range(100, 133))
    client.commit_staged("clicks", "q", "driver", 7, [a])
    trained = read_all(client, "clicks")
    cut, _ = client.prepare_cut()
    client.commit_cut(cut)
    b = stage(staging / "q" / "driver" / "8" / "b.parquet", range(133, 150))
    client.commit_staged("clicks", "q", "driver", 8, [b])

    master.kill()
    master.start()
    assert client.commit_staged("clicks", "q", "driver", 8, [b]).already_committed, "the key must be journalled"
    assert client.commit_staged("clicks", "q", "driver", 7, []).records == 33
    d = info(client)
    assert d.total_records == 50 and d.lag == 17 and d.records_committed == 33
    client.worker_id = ""
    trained += read_all(client, "clicks")
    assert sorted(trained) == list(range(100, 150)), "every committed record is read once"

    client.restore_cursor(DataCursor(), discard_committed=True)  # back to before anything was trained
    assert info(client).lag == 50
    assert sorted(read_all(client, "clicks", ack=False)) == list(range(100, 150))


def test_without_a_declared_schema_the_first_file_fixes_it(tmp_path: Path, client: ShardClient) -> None:
    client.register_dataset(DatasetSpec("free", "staged://free", "parquet"))
    assert info(client, "free").schema_json == "[]"
    first = stage(tmp_path / "a.parquet", range(0, 4))
    client.commit_staged("free", "p", "0", 0, [first])
    assert info(client, "free").schema_json == '[["id", "int64"], ["x", "float"]]'
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": [1, 2]}), other)
    with pytest.raises(InvalidArgumentError, match="other.parquet' has schema"):
        client.commit_staged("free", "p", "0", 1, [(str(other), 2)])
    assert sorted(read_all(client, "free")) == [0, 1, 2, 3]
