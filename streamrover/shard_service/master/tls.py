"""TLS on the master: its certificate and key (and, for mutual TLS, the CA of client certificates), reloaded
without a restart when the files change.

gRPC: :func:`grpc.dynamic_ssl_server_credentials` asks :meth:`ServerTls.grpc_fetch` at every new handshake;
it answers a new configuration when a file changed since the last one (one ``stat`` per file), so a
certificate rotated in place (cert-manager's Secret, mounted) is served from the next connection on;
connections already open keep theirs. HTTP (the dashboard and ``/metrics``): an :class:`ssl.SSLContext`
whose SNI callback swaps in a context of the new files the same way. A rotation caught half-written (a key
that does not match the certificate) keeps the previous configuration, with a warning.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from streamrover.shard_service.api import InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """``--tls-cert``, ``--tls-key`` (PEM) and, for mutual TLS, ``--tls-client-ca`` (clients must present a
    certificate it signed)."""

    cert: str
    key: str
    client_ca: str | None = None

    def paths(self) -> list[str]:
        return [self.cert, self.key, *([self.client_ca] if self.client_ca else [])]


def _stamp(paths: list[str]) -> tuple[tuple[int, int], ...]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


class ServerTls:
    """The master's certificate files, loaded now and again whenever they change."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        try:
            self._stamp = _stamp(files.paths())
            self._pem = self._read()
            self._ctx = self._http_context(self._pem)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgumentError(f"TLS files {files.paths()}: {exc}") from exc
        self.reloads = 0  # times new files were taken (for tests and logs)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        f = self.files
        return (Path(f.cert).read_bytes(), Path(f.key).read_bytes(),
                Path(f.client_ca).read_bytes() if f.client_ca else None)  # fmt: skip

    def _http_context(self, pem: tuple[bytes, bytes, bytes | None]) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.files.cert, self.files.key)  # (ssl reads files only; _read checked they match)
        if pem[2] is not None:
            ctx.load_verify_locations(cadata=pem[2].decode())
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def _changed(self) -> bool:
        """Take new files if they changed and load (called at each handshake)."""
        try:
            stamp = _stamp(self.files.paths())
        except OSError as exc:
            log.warning("TLS files: %s; serving the certificate loaded before", exc)
            return False
        with self._lock:
            if stamp == self._stamp:
                return False
            try:
                pem = self._read()
                ctx = self._http_context(pem)  # raises when the key does not match the certificate (half-written)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("TLS files changed but do not load (%s): serving the certificate loaded before", exc)
                return False
            self._stamp, self._pem, self._ctx = stamp, pem, ctx
            self.reloads += 1
        log.warning("TLS certificate reloaded from %s (new connections use it)", self.files.cert)
        return True

    def _grpc_config(self) -> Any:
        cert, key, ca = self._pem
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def grpc_fetch(self) -> Any:
        """gRPC's certificate-configuration fetcher: a new configuration when the files changed, else None."""
        return self._grpc_config() if self._changed() else None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that reload (mutual TLS when a client CA is set)."""
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(), self.grpc_fetch, require_client_authentication=self.files.client_ca is not None
        )

    def http_context(self) -> ssl.SSLContext:
        """An SSL context for the HTTP endpoint whose handshakes use the newest files."""
        outer = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        outer.minimum_version = ssl.TLSVersion.TLSv1_2
        outer.load_cert_chain(self.files.cert, self.files.key)

        def swap(sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: ssl.SSLContext) -> None:
            self._changed()
            sock.context = self._ctx

        outer.sni_callback = swap  # (called at every handshake, with or without SNI)
        if self.files.client_ca:
            outer.load_verify_locations(self.files.client_ca)
            outer.verify_mode = ssl.CERT_REQUIRED
        return outer


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an interface to bind) is reachable from this machine only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_warning(hosts: list[str]) -> str:
    """The warning of a master bound off loopback without TLS ("" when it is not)."""
    off = sorted({h for h in hosts if not is_loopback(h)})
    if not off:
        return ""
    return (f"INSECURE: the master listens on {', '.join(off)} without TLS: job tokens and data positions cross "
            "the network in plaintext, and anyone who reads one packet can act as the job; start it with "
            "--tls-cert and --tls-key (see the guide's security page)")  # fmt: skip


__all__ = ["ServerTls", "TlsFiles", "is_loopback", "plaintext_warning"]
