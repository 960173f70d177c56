"""``master.tls`` on Kubernetes: certificates from Secrets in cert-manager's layout, mounted into the pods.

A job spec names Secrets instead of files (the pods do not share the submitter's filesystem)::

    master:
      host: 0.0.0.0
      tls:
        secret: ledger-master-tls          # tls.crt, tls.key, ca.crt: a certificate for ledger-master.<ns>.svc
        client_secret: ledger-client-tls   # optional, mutual TLS: the job's client certificate

* the master pod mounts ``secret`` at :data:`TLS_MOUNT` and serves ``tls.crt``/``tls.key`` (it reloads them at every
  new handshake, so cert-manager renewing the Secret in place, which the kubelet projects into the volume, needs no
  restart); with ``client_secret`` it requires client certificates signed by that Secret's ``ca.crt``;
* node pods mount only ``ca.crt`` of ``secret`` (never the master's key) and, with ``client_secret``, the client
  certificate at :data:`CLIENT_TLS_MOUNT`, and get ``STREAMROVER_TLS_*`` pointing there;
* everyone checks the master's certificate against the name ``<job>-master.<namespace>.svc``
  (``STREAMROVER_TLS_SERVER_NAME``), whatever address reaches it (the Service's DNS name or its cluster IP);
* the operator's controller reads the Secrets through the API into the job's work directory.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrover.operator.api import LaunchError

if TYPE_CHECKING:
    from streamrover.shard_service.client.tls import ClientTls

TLS_MOUNT = "/var/run/streamrover/tls"
CLIENT_TLS_MOUNT = "/var/run/streamrover/client-tls"
TLS_VOLUME, CLIENT_TLS_VOLUME = "master-tls", "client-tls"
CRT, KEY, CA = "tls.crt", "tls.key", "ca.crt"  # cert-manager's keys


@dataclass(frozen=True)
class K8sTls:
    """The job's TLS Secrets and the name its master's certificate is checked against."""

    secret: str
    client_secret: str | None
    server_name: str

    @classmethod
    def of(cls, owner: dict[str, Any]) -> K8sTls | None:
        """From a ``StreamTrainJob`` body (``spec.job.master.tls``); None when it has no ``secret``."""
        meta = owner.get("metadata") or {}
        tls = (((owner.get("spec") or {}).get("job") or {}).get("master") or {}).get("tls") or {}
        if not tls.get("secret"):
            return None
        return cls(tls["secret"], tls.get("client_secret"), server_name(meta["name"], meta["namespace"]))

    def master_args(self) -> tuple[str, ...]:
        """The master's ``--tls-*`` flags, at the mounts."""
        mutual = ("--tls-client-ca", f"{CLIENT_TLS_MOUNT}/{CA}") if self.client_secret else ()
        return ("--tls-cert", f"{TLS_MOUNT}/{CRT}", "--tls-key", f"{TLS_MOUNT}/{KEY}", *mutual)

    def node_env(self) -> dict[str, str]:
        """``STREAMROVER_TLS_*`` of a node pod."""
        from streamrover.shard_service.client.tls import ClientTls

        cert, key = (f"{CLIENT_TLS_MOUNT}/{CRT}", f"{CLIENT_TLS_MOUNT}/{KEY}") if self.client_secret else (None, None)
        return ClientTls(f"{TLS_MOUNT}/{CA}", cert, key, self.server_name).env()

    def volumes(self, role: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The pod's volumes and mounts: the master gets its key pair (and the client CA), a node the CA (and its
        client certificate)."""
        def secret(volume: str, name: str, path: str, keys: tuple[str, ...] | None) -> tuple[dict[str, Any], ...]:
            items = {"items": [{"key": k, "path": k} for k in keys]} if keys else {}
            return ({"name": volume, "secret": {"secretName": name, "defaultMode": 0o400, **items}},
                    {"name": volume, "mountPath": path, "readOnly": True})  # fmt: skip

        pairs = [secret(TLS_VOLUME, self.secret, TLS_MOUNT, None if role == "master" else (CA,))]
        if self.client_secret:
            pairs.append(secret(CLIENT_TLS_VOLUME, self.client_secret, CLIENT_TLS_MOUNT,
                                (CA,) if role == "master" else None))  # fmt: skip
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def fetch(self, core: Any, namespace: str, folder: Path) -> ClientTls:
        """The controller's client settings: the Secrets read through the API into ``folder`` (0600 files);
        :class:`LaunchError` naming a Secret or key that is missing."""
        from streamrover.shard_service.client.tls import ClientTls

        folder.mkdir(parents=True, exist_ok=True)
        ca = _write(folder / "ca.crt", _read(core, namespace, self.secret, CA))
        if not self.client_secret:
            return ClientTls(str(ca), server_name=self.server_name)
        cert = _write(folder / "client.crt", _read(core, namespace, self.client_secret, CRT))
        key = _write(folder / "client.key", _read(core, namespace, self.client_secret, KEY))
        return ClientTls(str(ca), str(cert), str(key), self.server_name)


def server_name(job: str, namespace: str) -> str:
    """The name the master's certificate must carry (a DNS SAN): its Service's."""
    return f"{job}-master.{namespace}.svc"


def _read(core: Any, namespace: str, name: str, key: str) -> bytes:
    from kubernetes.client.exceptions import ApiException

    try:
        secret: Any = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise LaunchError(f"master.tls: no Secret {name!r} in namespace {namespace!r} (cert-manager's layout: "
                              f"{CRT}, {KEY}, {CA})") from None  # fmt: skip
        raise
    data = secret.data or {}
    if key not in data:
        raise LaunchError(f"master.tls: Secret {namespace}/{name} has no {key!r} (keys: {', '.join(sorted(data))}; "
                          f"cert-manager's layout is {CRT}, {KEY}, {CA})")  # fmt: skip
    return base64.b64decode(data[key])


def _write(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


__all__ = ["CLIENT_TLS_MOUNT", "TLS_MOUNT", "K8sTls", "server_name"]
