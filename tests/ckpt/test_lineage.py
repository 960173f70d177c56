"""Lineage (issue 13, item 5): each manifest says which offset ranges per partition its model learned from,
and ``streamrover checkpoints list|show URL`` prints them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from streamrover.ckpt import Checkpointer, RetentionPolicy
from streamrover.ckpt.layout import read_manifest
from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess, python_env
from tests.helpers import write_parquet_dataset


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in python_env().items() if k != "COLUMNS"}  # piped, as into a log
    return subprocess.run([sys.executable, "-m", "streamrover.cli", "checkpoints", *args], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip


def _train_shards(client: ShardClient, n: int, step: int) -> list[tuple[str, int, int]]:
    """Lease ``n`` shards, read them, ack them at ``step``: their (partition id, start, end)."""
    _, shards = client.lease("rows", max_shards=n)
    assert len(shards) == n
    for shard in shards:
        for _ in shard.batches(100):
            pass
        shard.ack(step=step, wait=True)
    return [(s.lease.partition.id, s.lease.start, s.lease.end) for s in shards]


def _expected(trained: list[tuple[str, int, int]]) -> dict[str, list[list[int]]]:
    cursor = DataCursor()
    for pid, start, end in trained:
        cursor.add(PartitionKey("rows", 0, pid), start, end)
    return {k.partition: iv.to_list() for k, iv in cursor.items()}


def test_manifests_carry_lineage_and_the_cli_prints_it(tmp_path: Path, master: MasterProcess) -> None:
    write_parquet_dataset(tmp_path / "data", 2_000, files=2, row_group_size=500)
    url = str(tmp_path / "ckpt")
    state = {"w": np.zeros(4, np.float32)}
    with ShardClient(master.address, token=master.token) as client:
        client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=250))
        ckpt = Checkpointer(url, binder=client, saver="thread", retention=RetentionPolicy(keep_last=5))
        first = _train_shards(client, 1, step=1)
        ckpt.save(1, state)
        ckpt.wait(timeout=60)
        second = _train_shards(client, 3, step=2)
        ckpt.save(2, state)
        ckpt.wait(timeout=60)
        ckpt.close()

    # the manifest itself: readable ranges per partition, the same as its cursor and as what was trained
    for step, trained in ((1, first), (2, first + second)):
        manifest = read_manifest(ckpt.storage, step)
        learned = {e["partition"]: e["ranges"] for e in manifest["lineage"]["learned"]}
        assert learned == _expected(trained), f"step {step}: the lineage is what the model was trained on"
        assert manifest["lineage"]["positions"] == 250 * len(trained)
        cursor = DataCursor.from_json(manifest["cursor"])
        assert {k.partition: iv.to_list() for k, iv in cursor.items()} == learned
        assert all(e["dataset"] == "rows" and e["epoch"] == 0 for e in manifest["lineage"]["learned"])

    (tmp_path / "ckpt" / "step-000000000003").mkdir()  # a persist that never finished: partial, listed as such
    listed = _cli("list", url)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = {line.split()[1]: line for line in listed.stdout.splitlines() if line.split()[1:2] in (["1"], ["2"], ["3"])}
    assert "complete" in rows["1"] and "250" in rows["1"], listed.stdout
    assert "1,000" in rows["2"] and "750 (since 1)" in rows["2"], listed.stdout
    assert "partial" in rows["3"], listed.stdout
    as_json = json.loads(_cli("list", url, "--json").stdout)
    assert [(d["step"], d["state"]) for d in as_json] == [(1, "complete"), (2, "complete"), (3, "partial")]

    shown = json.loads(_cli("show", url, "--json").stdout)  # the newest complete checkpoint
    assert shown["step"] == 2 and shown["previous_step"] == 1 and shown["new_positions"] == 750
    new = {e["partition"]: e["ranges"] for e in shown["new_since_previous"]}
    assert new == _expected(second), "what step 2 learned beyond step 1"
    text = _cli("show", url, "--step", "2")
    assert text.returncode == 0, text.stdout + text.stderr
    for pid, ranges in _expected(first + second).items():
        line = next(line for line in text.stdout.splitlines() if pid in line)
        assert ", ".join(f"[{a}, {b})" for a, b in ranges) in line, text.stdout
    assert "750 new since step 1" in text.stdout

    missing = _cli("show", url, "--step", "7")
    assert missing.returncode == 2 and "no checkpoint of step 7" in missing.stdout, missing.stdout
    assert "steps: 1, 2, 3" in missing.stdout, "the error names the steps there are"
    nowhere = _cli("list", str(tmp_path / "nothing-here"))
    assert nowhere.returncode == 2 and "no such checkpoint directory" in nowhere.stdout, nowhere.stdout
