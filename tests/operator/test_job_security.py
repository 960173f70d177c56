"""A job's security through the operator (issue 33): nodes get the worker token and the TLS settings, the local
platform starts a master with ``master.tls`` files, Kubernetes takes Secrets instead (and refuses files clearly)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from streamrover.operator.api import LaunchError, MasterLaunch, PlatformError
from streamrover.operator.local import LocalPlatform
from streamrover.operator.spec import SpecError, parse_spec
from streamrover.operator.supervisor import Supervisor
from streamrover.shard_service import ShardClient
from streamrover.shard_service.client.tls import ClientTls
from streamrover.testing.certs import issue, make_ca
from streamrover.tokens import worker_token
from tests.operator.test_supervisor import ScriptedPlatform

SPEC = {"name": "job", "datasets": [{"name": "d", "uri": "/data"}], "trainer": {"script": "/t.py", "nodes": 1}}


def test_nodes_get_the_worker_token_and_the_tls_settings_never_the_admin_token() -> None:
    platform = ScriptedPlatform()
    tls = ClientTls("/pki/ca.pem", "/pki/c.pem", "/pki/c.key")
    sup = Supervisor(parse_spec(SPEC), platform, run_id="r", master_address="127.0.0.1:1", token="admin-token",
                     ckpt_url="/ckpt", client_env=tls.env())  # fmt: skip
    sup.start()
    (launch,) = platform.launches
    assert launch.env["STREAMROVER_TOKEN"] == worker_token("admin-token")
    assert "admin-token" not in " ".join([*launch.env.values(), *launch.command])
    assert launch.env["STREAMROVER_TLS_CA"] == "/pki/ca.pem" and launch.env["STREAMROVER_TLS_KEY"] == "/pki/c.key"


def test_the_spec_says_how_the_master_serves_tls() -> None:
    spec = parse_spec({**SPEC, "master": {"tls": {"cert": "c.pem", "key": "k.pem", "ca": "ca.pem"}}})
    assert spec.master.tls is not None and spec.master.tls.master_args() == ("--tls-cert", "c.pem", "--tls-key",
                                                                            "k.pem")  # fmt: skip
    with pytest.raises((ValidationError, ValueError), match="client_ca .mutual TLS. needs client_cert"):
        parse_spec({**SPEC, "master": {"tls": {"cert": "c", "key": "k", "ca": "a", "client_ca": "a"}}})


def test_the_local_platform_starts_a_tls_master(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "pki")
    server = issue(ca, tmp_path / "pki", "server")
    spec = parse_spec({**SPEC, "master": {"tls": {"cert": str(server.cert), "key": str(server.key),
                                                  "ca": str(ca.cert)}}})  # fmt: skip
    assert spec.master.tls is not None
    platform = LocalPlatform(tmp_path / "logs")
    try:
        info = platform.launch_master(MasterLaunch("job", tmp_path / "master", "t0ken",
                                                   args=spec.master.tls.master_args()))  # fmt: skip
        with ShardClient(info.address, token="t0ken", heartbeat=False, timeout=30, tls=ClientTls(str(ca.cert))) as c:
            assert c.list_datasets() == []
    finally:
        platform.stop_master()
        platform.close()


def test_kubernetes_refuses_master_tls_files_with_a_clear_error() -> None:
    from streamrover.operator.k8s import K8sPlatform

    platform = K8sPlatform.__new__(K8sPlatform)  # no cluster needed: the refusal comes before any API call
    platform.tls = None
    with pytest.raises(LaunchError, match="master.tls on Kubernetes names Secrets, not files: master.tls.secret"):
        platform.launch_master(MasterLaunch("job", Path("/j"), "t", args=("--tls-cert", "c", "--tls-key", "k")))


def test_master_tls_is_files_or_a_secret_and_each_platform_takes_its_own() -> None:
    from streamrover.operator.k8s_files import for_pods

    with pytest.raises(SpecError, match="give the Secret or the files, not both .secret with cert."):
        parse_spec({**SPEC, "master": {"tls": {"secret": "s", "cert": "c"}}})
    with pytest.raises(SpecError, match="key, ca missing: give cert, key and ca .files., or secret"):
        parse_spec({**SPEC, "master": {"tls": {"cert": "c"}}})
    with pytest.raises(SpecError, match="client_secret goes with secret"):
        parse_spec({**SPEC, "master": {"tls": {"cert": "c", "key": "k", "ca": "a", "client_secret": "x"}}})
    on_k8s = parse_spec({**SPEC, "master": {"tls": {"secret": "s"}}})
    assert on_k8s.master.tls is not None
    with pytest.raises(PlatformError, match="master.tls.secret 's' is a Kubernetes Secret: on this platform give"):
        on_k8s.master.tls.master_args()  # the local and Ray controllers ask this
    files = parse_spec({**SPEC, "master": {"tls": {"cert": "c", "key": "k", "ca": "a"}}})
    with pytest.raises(SpecError, match="master.tls: cert, key and ca are files on this machine, not in the pods"):
        for_pods(files, Path("/"), "job.yaml")


def test_on_kubernetes_the_master_mounts_its_key_pair_and_nodes_only_the_ca_and_client_certificate() -> None:
    from streamrover.operator.k8s_tls import K8sTls

    body = {"metadata": {"name": "job", "namespace": "ns"},
            "spec": {"job": {**SPEC, "master": {"tls": {"secret": "m-tls", "client_secret": "c-tls"}}}}}  # fmt: skip
    tls = K8sTls.of(body)
    assert tls == K8sTls("m-tls", "c-tls", "job-master.ns.svc")
    assert tls.master_args() == ("--tls-cert", "/var/run/streamrover/tls/tls.crt", "--tls-key",
                                 "/var/run/streamrover/tls/tls.key", "--tls-client-ca",
                                 "/var/run/streamrover/client-tls/ca.crt")  # fmt: skip
    master, _ = tls.volumes("master")
    node, mounts = tls.volumes("node")
    assert [(v["secret"]["secretName"], v["secret"].get("items")) for v in master] == [
        ("m-tls", None), ("c-tls", [{"key": "ca.crt", "path": "ca.crt"}])]
    assert [(v["secret"]["secretName"], v["secret"].get("items")) for v in node] == [
        ("m-tls", [{"key": "ca.crt", "path": "ca.crt"}]), ("c-tls", None)]  # never the master's key
    assert all(m["readOnly"] for m in mounts)
    assert tls.node_env() == {"STREAMROVER_TLS_CA": "/var/run/streamrover/tls/ca.crt",
                              "STREAMROVER_TLS_CERT": "/var/run/streamrover/client-tls/tls.crt",
                              "STREAMROVER_TLS_KEY": "/var/run/streamrover/client-tls/tls.key",
                              "STREAMROVER_TLS_SERVER_NAME": "job-master.ns.svc"}  # fmt: skip
    assert K8sTls.of({"metadata": {"name": "j", "namespace": "n"}, "spec": {"job": SPEC}}) is None
