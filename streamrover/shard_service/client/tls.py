"""How a client verifies the master over TLS: settings from the environment, as the address and token are.

``STREAMROVER_TLS_CA``: a PEM file of the CA that signed the master's certificate; set, the client speaks TLS
and refuses a master whose certificate that CA did not sign (unset: plaintext). ``STREAMROVER_TLS_CERT`` and
``STREAMROVER_TLS_KEY``: this client's certificate and key, for a master that asks for them (mutual TLS).
``STREAMROVER_TLS_SERVER_NAME``: the name to check the certificate against, when the address is not it (an
IP address, a port-forward). The files are read when a client connects: a client started after a rotation
uses the new ones; the master's own certificate rotates under running clients without their noticing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from streamrover.shard_service.api import InvalidArgumentError

CA_ENV = "STREAMROVER_TLS_CA"
CERT_ENV = "STREAMROVER_TLS_CERT"
KEY_ENV = "STREAMROVER_TLS_KEY"
SERVER_NAME_ENV = "STREAMROVER_TLS_SERVER_NAME"
TLS_ENVS = (CA_ENV, CERT_ENV, KEY_ENV, SERVER_NAME_ENV)


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS settings: the CA to verify the master by, and optionally its own certificate and key."""

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientTls | None:
        """The settings in ``env`` (default ``os.environ``); None when ``STREAMROVER_TLS_CA`` is unset."""
        env = os.environ if env is None else env
        ca = env.get(CA_ENV, "")
        cert, key = env.get(CERT_ENV) or None, env.get(KEY_ENV) or None
        if not ca:
            if cert or key:
                raise InvalidArgumentError(f"{CERT_ENV}/{KEY_ENV} are set but {CA_ENV} is not: set the master's CA")
            return None
        return cls(ca, cert, key, env.get(SERVER_NAME_ENV) or None)

    def env(self) -> dict[str, str]:
        """These settings as environment variables (for processes a launcher starts)."""
        out = {CA_ENV: self.ca, CERT_ENV: self.cert or "", KEY_ENV: self.key or ""}
        return {**out, SERVER_NAME_ENV: self.server_name} if self.server_name else out

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials of these files; InvalidArgumentError naming a file that cannot be read."""
        if bool(self.cert) != bool(self.key):
            raise InvalidArgumentError(f"{CERT_ENV} and {KEY_ENV} go together: give both or neither")

        def read(what: str, path: str | None) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgumentError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from None

        return grpc.ssl_channel_credentials(read("CA", self.ca), read("key", self.key), read("certificate", self.cert))

    def options(self) -> list[tuple[str, Any]]:
        """Channel options (the name the master's certificate is checked against)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_tls_args(parser: Any) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key`` on a launcher's parser (defaults: the environment)."""
    parser.add_argument("--tls-ca", "--tls_ca", default=os.environ.get(CA_ENV),
                        help=f"verify the master's certificate by this CA (PEM): TLS (default ${CA_ENV})")
    parser.add_argument("--tls-cert", "--tls_cert", default=os.environ.get(CERT_ENV),
                        help=f"this node's client certificate, for mutual TLS (default ${CERT_ENV})")
    parser.add_argument("--tls-key", "--tls_key", default=os.environ.get(KEY_ENV),
                        help=f"its key (default ${KEY_ENV})")  # fmt: skip


def export_tls_args(args: Any) -> None:
    """Put a launcher's ``--tls-*`` into ``os.environ``: its own clients and every process it starts use them."""
    for name, value in ((CA_ENV, args.tls_ca), (CERT_ENV, args.tls_cert), (KEY_ENV, args.tls_key)):
        if value:
            os.environ[name] = str(Path(value).resolve())
    ClientTls.from_env()  # a key without a CA is refused here, naming the variables


def channel(address: str, options: list[tuple[str, Any]], tls: ClientTls | None) -> grpc.Channel:
    """A channel to ``address``: TLS when ``tls`` is set, plaintext otherwise."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options + tls.options())


__all__ = [
    "CA_ENV", "CERT_ENV", "KEY_ENV", "SERVER_NAME_ENV", "TLS_ENVS", "ClientTls", "add_tls_args", "channel",
    "export_tls_args",
]  # fmt: skip
