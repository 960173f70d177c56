"""The Flink sink's Java committer against a real job master whose connection is cut mid-``CommitStaged``.

The committer runs outside Flink (tests/sinks/CommitterHarness.java, as Flink's committer operator drives
it) and reaches the master through :class:`CutProxy`, which forwards a commit's request whole and then

- ``kill``: SIGKILLs the master before its answer (the master restarts on its state dir and port): grpc-java
  reports UNAVAILABLE;
- ``reset``: lets the master answer and resets the committer's connection instead (the commit landed,
  unknown to the committer): UNAVAILABLE;
- ``garble``: the same with a garbled HTTP/2 frame in place of the answer's trailers: INTERNAL, which the
  committer of before issue 26 counted as failed and dropped (``outcome ... failed`` here).

The committer logs the status with the commit's key, retries, and each commit lands exactly once
(``already_committed`` when the lost answer was a success). About 5 s per case.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.shard_service.client.tls import ClientTls
from streamrover.sources.staged import encode_schema
from streamrover.testing.certs import issue, make_ca
from streamrover.testing.procs import MasterProcess
from streamrover.tokens import worker_token
from tests.sinks.flink import FLINK_VENV, build_sink
from tests.sinks.flink_proxy import CutProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HERE = Path(__file__).resolve().parent
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("y", pa.float64())])
PRODUCER = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="session")
def flink_sink_jar() -> Path:
    return build_sink()


def stage(staging: Path, part: str, epoch: int, first: int, rows: int, producer: str = PRODUCER) -> str:
    """A staged Parquet file as the sink writes it: ``<staging>/<producer>/<part>/<epoch>/<file>``."""
    folder = staging / producer / part / str(epoch)
    folder.mkdir(parents=True)
    x = [float(i) for i in range(rows)]
    table = pa.table([list(range(first, first + rows)), x, [3.0 * v + 1.0 for v in x]], schema=SCHEMA)
    pq.write_table(table, folder / "a0-test-0.parquet")
    return str(folder / "a0-test-0.parquet")


def flink_jars() -> list[Path]:
    """Flink's own classes and its logging, from the PyFlink venv."""
    lib = next(FLINK_VENV.glob("lib/python*/site-packages/pyflink/lib"))
    return [*sorted(lib.glob("flink-dist-*.jar")), *sorted(lib.glob("log4j-*.jar"))]


def run_committer(jar: Path, master: str, token: str, staging: Path, commits: Sequence[tuple[str, int | str, str, int]],
                  env: dict[str, str] | None = None) -> str:  # fmt: skip
    """Run the harness over ``commits``: (part, epoch or "epoch:previous", uri, records)."""
    jars = [jar, *flink_jars()]
    cmd = ["java", "-Dorg.apache.logging.log4j.level=INFO", "-cp", ":".join(map(str, jars)),
           str(HERE / "CommitterHarness.java"), master, token, "stream", str(staging), "60"]  # fmt: skip
    for part, epoch, uri, records in commits:
        cmd += [PRODUCER, part, str(epoch), uri, str(records)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    return out.stdout + out.stderr + f"\nexit {out.returncode}"


@pytest.mark.parametrize("cut", ["kill", "reset", "garble"])
def test_a_commit_cut_mid_call_is_retried_and_lands_once(tmp_path: Path, flink_sink_jar: Path, cut: str) -> None:
    staging = tmp_path / "staging"
    master = MasterProcess(tmp_path / "master")
    master.start()
    proxy = CutProxy(lambda: master.address)
    restarted = threading.Event()
    rows = [300, 500, 700]

    def restart() -> None:
        master.start()
        restarted.set()

    def kill_and_restart() -> None:  # the proxy kills the master mid-call; it comes back on its state dir
        master.kill()
        threading.Thread(target=restart, daemon=True).start()

    try:
        with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
            options = {"sr.staging_dir": str(staging), "sr.schema": encode_schema(SCHEMA)}
            admin.register_dataset(DatasetSpec("stream", "staged://stream", options=options, records_per_shard=1000))
        commits = [(str(i), i + 1, stage(staging, str(i), i + 1, 10_000 * i, n), n) for i, n in enumerate(rows)]
        fired = proxy.arm(cut, kill_and_restart)  # the first commit's call is cut
        out = run_committer(flink_sink_jar, proxy.address, master.token, staging, commits)
        assert fired.is_set(), f"the proxy never cut a call\n{out}"
        if cut == "kill":
            assert restarted.wait(60), f"the master did not come back\n{master.log_tail()}"
        statuses = re.findall(r"CommitStaged of \S+ failed with (\w+)", out)
        print(f"{cut}: committer retried after {statuses}\n{out[-3000:]}")
        assert statuses and set(statuses) <= {"UNKNOWN", "UNAVAILABLE", "INTERNAL"}, out
        outcomes = re.findall(r"^outcome (\S+) (\w+)$", out, re.M)
        first = "already" if cut != "kill" else outcomes[0][1]  # a killed master may have committed, or not
        assert [o for _, o in outcomes] == [first, "committed", "committed"], out
        assert first in ("committed", "already") and out.rstrip().endswith("exit 0"), out
        with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
            info = admin.describe_dataset("stream")
        assert info.total_records == sum(rows), f"{info.total_records} records committed, not {sum(rows)}\n{out}"
    finally:
        proxy.close()
        master.stop()


def test_the_committer_commits_over_mutual_tls_with_the_worker_token(tmp_path: Path, flink_sink_jar: Path) -> None:
    """Issue 33: the Java committer takes STREAMROVER_TLS_CA/_CERT/_KEY from the environment, as Python does."""
    ca = make_ca(tmp_path / "pki")
    server, client = issue(ca, tmp_path / "pki", "server"), issue(ca, tmp_path / "pki", "committer", server=False)
    staging = tmp_path / "staging"
    master = MasterProcess(tmp_path / "master", extra_args=[
        "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca.cert)])  # fmt: skip
    master.start()
    tls = ClientTls(str(ca.cert), str(client.cert), str(client.key))
    try:
        with ShardClient(master.address, token=master.token, heartbeat=False, tls=tls) as admin:
            options = {"sr.staging_dir": str(staging), "sr.schema": encode_schema(SCHEMA)}
            admin.register_dataset(DatasetSpec("stream", "staged://stream", options=options, records_per_shard=1000))
            commits = [("0", 1, stage(staging, "0", 1, 0, 400), 400)]
            out = run_committer(flink_sink_jar, master.address, worker_token(master.token), staging, commits,
                                env=tls.env())  # fmt: skip
            assert [o for _, o in re.findall(r"^outcome (\S+) (\w+)$", out, re.M)] == ["committed"], out
            assert "over TLS" in out and out.rstrip().endswith("exit 0"), out
            assert admin.describe_dataset("stream").total_records == 400
    finally:
        master.stop()


def test_a_restored_writer_deletes_only_its_epochs_after_the_restored_checkpoint(
    tmp_path: Path, flink_sink_jar: Path
) -> None:
    """Epoch folders above the restored checkpoint K of the writer's own (producer, part) go; nothing else."""
    staging = tmp_path / "staging"
    for producer, part, epoch in [(PRODUCER, "0", e) for e in (3, 4, 5, 12)] + [(PRODUCER, "1", 9), ("other", "0", 9)]:
        stage(staging, part, epoch, 0, 10, producer)
    classes = tmp_path / "classes"
    cp = ":".join(map(str, [flink_sink_jar, *flink_jars()]))
    javac = subprocess.run(["javac", "-d", str(classes), "-cp", cp, str(HERE / "WriterHarness.java")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert javac.returncode == 0, javac.stderr

    logs: list[str] = []

    def left(restored: str) -> list[str]:
        out = subprocess.run(["java", "-Dorg.apache.logging.log4j.level=INFO", "-cp", f"{classes}:{cp}",
                              "streamrover.flink.WriterHarness", str(staging), PRODUCER, "0", restored],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        logs.append(out.stdout + out.stderr)
        return re.findall(r"^left (\S+)$", out.stdout, re.M)

    assert left("none") == ["12", "3", "4", "5", "_inprogress"], "a writer that was not restored deletes no epoch"
    assert left("4") == ["3", "4", "_inprogress"], "restored from checkpoint 4: epochs 5 and 12 are garbage"
    assert "deleted 2 epoch folder(s) (2 files)" in logs[-1], logs[-1]
    assert (staging / PRODUCER / "1" / "9").is_dir() and (staging / "other" / "0" / "9").is_dir(), "not its own"


def test_the_committer_sends_previous_epoch_and_the_master_shows_the_gap(tmp_path: Path, flink_sink_jar: Path) -> None:
    """Checkpoint 5 of subtask 0 commits before 4 (whose commit Flink retries later): the master shows the gap
    the committer's previous_epoch names, and 4's late commit closes it. About 5 s."""
    staging = tmp_path / "staging"
    master = MasterProcess(tmp_path / "master")
    master.start()
    try:
        with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
            options = {"sr.staging_dir": str(staging), "sr.schema": encode_schema(SCHEMA)}
            admin.register_dataset(DatasetSpec("stream", "staged://stream", options=options, records_per_shard=1000))
            three, four, five = (stage(staging, "0", e, 100 * e, 10) for e in (3, 4, 5))
            out = run_committer(flink_sink_jar, master.address, master.token, staging,
                                [("0", 3, three, 10), ("0", "5:4", five, 10)])  # fmt: skip
            assert out.rstrip().endswith("exit 0"), out
            gaps = [(g.producer, g.part, g.epoch, g.next_epoch) for g in admin.describe_dataset("stream").commit_gaps]
            assert gaps == [(PRODUCER, "0", 4, 5)], out
            out = run_committer(flink_sink_jar, master.address, master.token, staging, [("0", "4:3", four, 10)])
            assert out.rstrip().endswith("exit 0"), out
            info = admin.describe_dataset("stream")
            assert list(info.commit_gaps) == [] and info.total_records == 30, out
    finally:
        master.stop()


def test_the_tls_proxy_ends_a_connection_whose_client_sent_close_notify(tmp_path: Path) -> None:
    """The chaos proxy's TLS side after a close_notify: CPython's read answers b"" (at every call), and a pump that
    took it for "more to read" spun for good, growing one list to 21 GB inside a CI run (the suite's process, long
    after the Flink test). Now the connection ends: the upstream sees EOF and the pump thread is gone."""
    import socket
    import ssl

    from tests.sinks.flink_proxy import ProxyTls

    ca = make_ca(tmp_path / "ca")
    server = issue(ca, tmp_path / "server", "server")
    upstream_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    upstream_ctx.load_cert_chain(str(server.cert), str(server.key))
    listener = socket.create_server(("127.0.0.1", 0))
    proxy = CutProxy(lambda: f"127.0.0.1:{listener.getsockname()[1]}",
                     ProxyTls(str(server.cert), str(server.key), str(ca.cert)))  # fmt: skip
    got: list[bytes] = []

    def serve() -> None:  # the master's side: TLS, collects what arrives until EOF
        conn, _ = listener.accept()
        with upstream_ctx.wrap_socket(conn, server_side=True) as tls:
            while data := tls.recv(65536):
                got.append(data)

    upstream = threading.Thread(target=serve, daemon=True)
    upstream.start()
    pumps_before = {t for t in threading.enumerate() if t.name.endswith("(_pump)")}
    host, port = proxy.address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=30)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context(cafile=str(ca.cert)).wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    try:
        while True:  # the handshake over memory BIOs
            try:
                client.do_handshake()
                break
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())
                incoming.write(raw.recv(65536))
        client.write(b"hello")
        try:
            client.unwrap()  # close_notify (not waiting for the proxy's); the TCP connection stays open
        except ssl.SSLWantReadError:
            pass
        raw.sendall(outgoing.read())
        upstream.join(30)
        assert not upstream.is_alive(), "the proxied connection did not end after the client's close_notify"
        assert b"".join(got) == b"hello"
        pumps = [t for t in threading.enumerate() if t.name.endswith("(_pump)") and t not in pumps_before]
        for pump in pumps:
            pump.join(30)
        assert not any(p.is_alive() for p in pumps), "the proxy's pump still runs"
    finally:
        raw.close()
        proxy.close()
        listener.close()
