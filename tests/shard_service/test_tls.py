"""TLS on the wire (issue 33, item 1-2): refusals, mutual TLS, HTTPS for /metrics, certificates reloaded live.

Real masters in this process with certificates the ``openssl`` command made; real gRPC and HTTPS clients.
A refused TLS handshake is UNAVAILABLE (or, waiting for a ready channel, DEADLINE_EXCEEDED) to a gRPC client,
retried until its timeout (here 1 s), with a hint about TLS.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrover.shard_service import MasterServer, ShardClient, ShardServiceError
from streamrover.shard_service.client.tls import ClientTls
from streamrover.shard_service.master.tls import TlsFiles
from streamrover.testing.certs import Pair, issue, make_ca
from streamrover.testing.procs import python_env
from streamrover.tokens import new_token


@dataclass(frozen=True)
class Certs:
    ca: Pair
    server: Pair
    client: Pair
    other_ca: Pair  # signed nothing the master serves
    other_server: Pair  # the other CA's server certificate (a rotation to a new CA)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    root = tmp_path_factory.mktemp("certs")
    ca, other = make_ca(root, "ca"), make_ca(root, "other")
    return Certs(ca, issue(ca, root, "server"), issue(ca, root, "client", server=False), other,
                 issue(other, root, "other-server"))  # fmt: skip


def _served(folder: Path, pair: Pair) -> TlsFiles:
    """Copies of ``pair`` the master serves (so a test can swap them in place)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(pair.cert, folder / "tls.crt")
    shutil.copy(pair.key, folder / "tls.key")
    return TlsFiles(str(folder / "tls.crt"), str(folder / "tls.key"))


def _swap(files: TlsFiles, pair: Pair) -> None:
    """Rotate in place as cert-manager does (each file replaced whole)."""
    for src, dst in ((pair.key, files.key), (pair.cert, files.cert)):
        shutil.copy(src, dst + ".new")
        Path(dst + ".new").rename(dst)


def _refused() -> pytest.RaisesContext[ShardServiceError]:
    return pytest.raises(ShardServiceError, match=r"\[(UNAVAILABLE|DEADLINE_EXCEEDED) from .*\] \((TLS|plaintext)")


def _client(master: MasterServer, token: str, tls: ClientTls | None, timeout: float = 1.0) -> ShardClient:
    return ShardClient(master.address, token=token, heartbeat=False, timeout=timeout, tls=tls)


def test_plaintext_and_wrong_ca_clients_are_refused_and_certs_reload(tmp_path: Path, certs: Certs) -> None:
    token = new_token()
    files = _served(tmp_path / "tls", certs.server)
    master = MasterServer(tmp_path / "state", token, tls=files, http_port=0)
    good, wrong = ClientTls(str(certs.ca.cert)), ClientTls(str(certs.other_ca.cert))
    try:
        assert master.security_warning == ""
        with _client(master, token, good) as c:
            assert c.list_datasets() == []
        for tls in (None, wrong):  # plaintext, and a CA that did not sign the master's certificate
            with _client(master, token, tls) as c, _refused():
                c.list_datasets()

        # /metrics over HTTPS with the same certificate; plain HTTP gets no answer
        url = master.dashboard.url + "metrics" if master.dashboard else ""
        assert url.startswith("https://")
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        ctx = ssl.create_default_context(cafile=str(certs.ca.cert))
        with urllib.request.urlopen(request, context=ctx, timeout=10) as answer:
            assert b"streamrover_" in answer.read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https://", "http://"), timeout=10)

        kept = _client(master, token, good, timeout=10)  # a connection open across the rotation
        assert kept.list_datasets() == []
        _swap(files, certs.other_server)  # rotated to a certificate of another CA: no restart
        with _client(master, token, wrong) as c:
            assert c.list_datasets() == [], "a new connection gets the new certificate"
        with _client(master, token, good) as c, _refused():
            c.list_datasets()
        assert kept.list_datasets() == [], "an open connection keeps working"
        kept.close()
        other_ctx = ssl.create_default_context(cafile=str(certs.other_ca.cert))
        with urllib.request.urlopen(request, context=other_ctx, timeout=10) as answer:
            assert answer.status == 200, "HTTPS serves the new certificate too"
        assert master.tls is not None and master.tls.reloads == 1
    finally:
        master.stop()


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path: Path, certs: Certs) -> None:
    token = new_token()
    served = _served(tmp_path / "tls", certs.server)
    files = TlsFiles(served.cert, served.key, client_ca=str(certs.ca.cert))
    master = MasterServer(tmp_path / "state", token, tls=files)
    try:
        with _client(master, token, ClientTls(str(certs.ca.cert))) as c, _refused():
            c.list_datasets()
        mine = ClientTls(str(certs.ca.cert), str(certs.client.cert), str(certs.client.key))
        with _client(master, token, mine) as c:
            assert c.list_datasets() == []
    finally:
        master.stop()


def test_the_cli_speaks_tls_from_the_environment(tmp_path: Path, certs: Certs) -> None:
    token = new_token()
    master = MasterServer(tmp_path / "state", token, tls=_served(tmp_path / "tls", certs.server))
    try:
        base = [sys.executable, "-m", "streamrover.cli", "dataset", "list", "--master", master.address, "--timeout",
                "1", f"--token={token}"]  # fmt: skip
        env = {**python_env(), "STREAMROVER_TLS_CA": str(certs.ca.cert)}
        ok = subprocess.run(base, capture_output=True, text=True, env=env, timeout=60)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        plain = subprocess.run(base, capture_output=True, text=True, env=python_env(), timeout=60)
        assert plain.returncode != 0 and "set STREAMROVER_TLS_CA" in plain.stdout + plain.stderr
    finally:
        master.stop()


def test_master_stop_needs_the_admin_token_and_stops_the_master(
    tmp_path: Path, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamrover.cli import main
    from streamrover.tokens import worker_token

    token = new_token()
    master = MasterServer(tmp_path / "state", token, tls=_served(tmp_path / "tls", certs.server))
    try:
        stop = ["master", "stop", "--master", master.address, "--timeout", "5", "--reason", "maintenance", "--tls-ca",
                str(certs.ca.cert)]  # fmt: skip
        assert main([*stop, f"--token={worker_token(token)}"]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert "Stop" in out and "worker role" in out and not master.servicer.stopping, out
        assert main([*stop, f"--token={token}"]) == 0
        assert f"master {master.address} stopping (maintenance)" in capsys.readouterr().out
        master.wait()  # the Stop call ended it
        assert master.servicer.stopping
    finally:
        master.stop()
