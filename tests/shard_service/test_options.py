"""Dataset options are validated before anything is journalled or any broker is contacted (issue 15, item 2)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.shard_service import DatasetSpec, InvalidArgumentError, ShardClient
from streamrover.shard_service.api import DatasetSpec as Spec
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import SourceKind
from streamrover.testing.procs import MasterProcess, python_env
from tests.helpers import wait_until, write_parquet_dataset

# nothing listens on port 1: a source that tried to reach its broker would time out, not answer INVALID_ARGUMENT
NO_BROKER = {
    "kafka": "kafka://127.0.0.1:1/t",
    "pulsar": "pulsar://127.0.0.1:1/t",
    "rocketmq": "rocketmq://127.0.0.1:1/t",
}


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    """One master for the module: a refused dataset leaves nothing behind (each test checks that)."""
    with MasterProcess(tmp_path_factory.mktemp("options") / "master") as m:
        yield m


@pytest.fixture
def client(master: MasterProcess) -> Iterator[ShardClient]:
    c = ShardClient(master.address, token=master.token, heartbeat=False, timeout=30)
    yield c
    c.close()


@pytest.mark.parametrize(
    ("scheme", "key", "value", "accepted"),
    [
        ("kafka", "sr.max_delay_ms", "abc", "milliseconds"),
        ("kafka", "sr.max_pending_shards", "0", "at least 1"),
        ("kafka", "sr.start", "yesterday", "timestamp:MILLIS"),
        ("kafka", "sr.format", "avro", "raw"),
        ("pulsar", "sr.poll_interval_ms", "-5", "milliseconds"),
        ("pulsar", "sr.entry_bits", "99", "16"),
        ("pulsar", "sr.start", "group", "earliest"),
        ("rocketmq", "sr.read_timeout_ms", "soon", "milliseconds"),
        ("rocketmq", "sr.start", "timestamp:5", "group"),
    ],
)
def test_a_bad_option_value_is_refused_naming_key_value_and_forms(
    client: ShardClient, scheme: str, key: str, value: str, accepted: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.register_dataset(DatasetSpec("x", NO_BROKER[scheme], options={key: value}))
    message = str(err.value)
    assert key in message and repr(value) in message and accepted in message, message
    assert client.list_datasets() == [], "nothing may be journalled for a refused dataset"


@pytest.mark.parametrize("scheme", sorted(NO_BROKER))
def test_an_unknown_sr_option_is_refused(client: ShardClient, scheme: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.register_dataset(DatasetSpec("x", NO_BROKER[scheme], options={"sr.max_dealy_ms": "10"}))
    message = str(err.value)
    assert "sr.max_dealy_ms" in message and "sr.max_delay_ms" in message, message  # names it and what is known
    assert client.list_datasets() == []


@pytest.mark.parametrize(("scheme", "key"), [("kafka", "fetch.wait.max.ms"), ("kafka", "no.such.setting"),
                                             ("pulsar", "no_such_argument")])  # fmt: skip
def test_a_bad_client_option_is_refused_before_the_broker_is_contacted(
    client: ShardClient, scheme: str, key: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=key):
        client.register_dataset(DatasetSpec("x", NO_BROKER[scheme], options={key: "abc"}))


def test_file_datasets_refuse_stream_options(tmp_path: Path, client: ShardClient) -> None:
    write_parquet_dataset(tmp_path / "data", 100, files=1, row_group_size=50)
    with pytest.raises(InvalidArgumentError, match="sr.max_delay_ms"):
        client.register_dataset(DatasetSpec("f", str(tmp_path / "data"), options={"sr.max_delay_ms": "5"}))
    with pytest.raises(InvalidArgumentError, match="cache_partitions"):
        client.register_dataset(DatasetSpec("f", str(tmp_path / "data"), options={"cache_partitions": "two"}))
    assert client.list_datasets() == []


def test_cli_names_the_bad_option_at_once(master: MasterProcess) -> None:
    cmd = [sys.executable, "-m", "streamrover.cli", "dataset", "add", "x", NO_BROKER["kafka"], "--option",
           "sr.max_delay_ms=abc", "--master", master.address, "--token", master.token, "--timeout", "30"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**python_env(), "COLUMNS": "200"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sr.max_delay_ms" in done.stdout and "'abc'" in done.stdout and "DEADLINE" not in done.stdout, done.stdout
    bad = subprocess.run([*cmd[:7], "--option", "no-equals-sign", *cmd[9:]], capture_output=True, text=True,
                         timeout=60, env=python_env())  # fmt: skip
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_a_journalled_dataset_with_bad_options_fails_instead_of_stopping_the_master(tmp_path: Path) -> None:
    """A journal written before options were validated: the master starts and shows the dataset failed."""
    state = tmp_path / "state"
    journal = Journal(state / "journal.db")
    spec = Spec("old", NO_BROKER["kafka"], options={"sr.poll_interval_ms": "often"})
    with journal.transaction():
        journal.put_dataset(DatasetRecord(spec, SourceKind.STREAM, [], "[]", epochs_planned=1))
    journal.close()
    with MasterProcess(state) as master, ShardClient(master.address, token=master.token, heartbeat=False) as c:

        def failed() -> bool:
            info = c.describe_dataset("old")
            return info.failed and "sr.poll_interval_ms" in info.error

        wait_until(failed, 30, "the dataset with bad options to show as failed")


@pytest.mark.parametrize("scheme", ["pulsar", "rocketmq"])
def test_a_workers_read_waits_for_a_broker_as_long_as_the_master_does(scheme: str) -> None:
    """A shard read gives up on an unreachable broker only after the master's grace for a missing topic: with
    the old 60 s default a broker restart of 60-120 s made every worker exit while the master waited it out."""
    from streamrover.sources.api import open_source

    def read_timeout(**options: str) -> float:
        source = open_source(NO_BROKER[scheme], "raw", options)  # constructors do no I/O
        try:
            return float(source.read_timeout)  # type: ignore[attr-defined]
        finally:
            source.close()

    assert read_timeout() == 120.0  # sr.missing_grace_ms's default
    assert read_timeout(**{"sr.missing_grace_ms": "300000"}) == 300.0
    assert read_timeout(**{"sr.missing_grace_ms": "300000", "sr.read_timeout_ms": "5000"}) == 5.0
