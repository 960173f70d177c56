"""The file source: formats, URIs, row ranges, and errors found at open time."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.sources import SourceNotFoundError, SourceSchemaError, open_source
from streamrover.sources.files import FileSource
from streamrover.testing.procs import MasterProcess


def _ids(source: FileSource, batch_size: int = 7) -> list[int]:
    out: list[int] = []
    for part in source.partitions():
        for batch in source.read(part, part.start, part.end, batch_size):
            assert batch.end - batch.start == batch.num_records
            out.extend(batch.records.column("id").to_pylist())
    return out


def test_parquet_row_groups_are_partitions(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": list(range(100))}), tmp_path / "a.parquet", row_group_size=30)
    pq.write_table(pa.table({"id": list(range(100, 150))}), tmp_path / "b.parquet", row_group_size=30)
    source = open_source(str(tmp_path / "*.parquet"))
    assert isinstance(source, FileSource)
    parts = source.partitions()
    assert [p.id.rsplit("/", 1)[1] for p in parts] == [
        "a.parquet#rg0",
        "a.parquet#rg1",
        "a.parquet#rg2",
        "a.parquet#rg3",
        "b.parquet#rg0",
        "b.parquet#rg1",
    ]
    assert [p.end for p in parts] == [30, 30, 30, 10, 30, 20]
    assert _ids(source) == list(range(150))


def test_a_shard_reads_only_its_rows(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": list(range(100))}), tmp_path / "a.parquet", row_group_size=50)
    source = open_source(str(tmp_path / "a.parquet"))
    second = source.partitions()[1]
    batches = list(source.read(second, 10, 23, 5))
    assert [(b.start, b.end) for b in batches] == [(10, 15), (15, 20), (20, 23)]
    assert [i for b in batches for i in b.records.column("id").to_pylist()] == list(range(60, 73))
    assert batches[0].records.to_pylist()[0] == {"id": 60}  # records as dicts too
    with pytest.raises(Exception, match="outside partition"):
        list(source.read(second, 40, 60, 5))


def test_csv_and_jsonl(tmp_path: Path) -> None:
    pacsv.write_csv(pa.table({"id": [0, 1, 2], "v": ["a", "b", "c"]}), tmp_path / "x.csv")
    (tmp_path / "y.jsonl").write_text("".join(json.dumps({"id": i, "v": str(i)}) + "\n" for i in range(5)))
    assert _ids(open_source(str(tmp_path / "x.csv"))) == [0, 1, 2]
    jl = open_source(str(tmp_path / "y.jsonl"))
    assert jl.partitions()[0].end == 5
    assert _ids(jl, 2) == [0, 1, 2, 3, 4]
    # An explicit format overrides the suffix.
    (tmp_path / "z.data").write_text('{"id": 9}\n')
    assert _ids(open_source(str(tmp_path / "z.data"), "jsonl")) == [9]


def test_fsspec_urls(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    for i in range(3):
        with fs.open(f"/bucket/d/part-{i}.parquet", "wb") as fh:
            pq.write_table(pa.table({"id": np.arange(i * 10, i * 10 + 10)}), fh)
    source = open_source("memory://bucket/d/*.parquet")
    assert len(source.partitions()) == 3
    assert all(p.id.startswith("memory://") for p in source.partitions())
    assert _ids(source) == list(range(30))
    with pytest.raises(SourceNotFoundError):
        open_source("memory://bucket/none/*.parquet")


def test_csv_schema_mismatch(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,v\n1,2\n")
    (tmp_path / "b.csv").write_text("id,w\n1,2\n")
    with pytest.raises(SourceSchemaError, match="a.csv.*b.csv"):
        open_source(str(tmp_path / "*.csv"))


def test_mixed_formats_need_a_format(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1]}), tmp_path / "a.parquet")
    (tmp_path / "b.csv").write_text("id\n1\n")
    with pytest.raises(Exception, match="several formats"):
        open_source(str(tmp_path))


def test_jsonl_dataset_through_the_master(tmp_path: Path, master: MasterProcess) -> None:
    d = tmp_path / "events"
    d.mkdir()
    for f in range(3):
        (d / f"e{f}.jsonl").write_text("".join(json.dumps({"id": f * 100 + i}) + "\n" for i in range(40)))
    with ShardClient(master.address, token=master.token) as client:
        client.register_dataset(DatasetSpec("events", str(d), records_per_shard=16, epochs=2, shuffle=True, seed=3))
        seen: list[int] = []
        epochs = set()
        order = []
        for shard in client.shards("events"):
            epochs.add(shard.lease.epoch)
            order.append((shard.lease.epoch, shard.lease.partition.index, shard.lease.start))
            for batch in shard.batches(5):
                seen.extend(batch.records.column("id").to_pylist())
                shard.ack(batch.end)
    expected = sorted(f * 100 + i for f in range(3) for i in range(40))
    assert sorted(seen) == sorted(expected * 2)
    assert epochs == {0, 1}
    assert order != sorted(order)  # the seeded shuffle changed the order of shards within an epoch
