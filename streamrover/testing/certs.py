"""Certificates for tests and benchmarks, made with the ``openssl`` command (a CA, server and client certs)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    """A certificate and its key (PEM files)."""

    cert: Path
    key: Path


def make_ca(folder: Path, name: str = "ca") -> Pair:
    """A self-signed CA (EC P-256, one day)."""
    folder.mkdir(parents=True, exist_ok=True)
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-subj", f"/CN=streamrover test {name}", "-keyout", str(key), "-out", str(cert), cwd=folder)  # fmt: skip
    return Pair(cert, key)


def issue(ca: Pair, folder: Path, name: str, *, server: bool = True, dns: tuple[str, ...] = ()) -> Pair:
    """A certificate signed by ``ca``: for a server (localhost, 127.0.0.1 and the names ``dns``) or a client."""
    folder.mkdir(parents=True, exist_ok=True)
    key, csr, cert, ext = (folder / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    usage = "serverAuth" if server else "clientAuth"
    names = "".join(f",DNS:{d}" for d in dns)
    san = f"subjectAltName=DNS:localhost,IP:127.0.0.1{names}\n" if server else ""
    ext.write_text(f"{san}extendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(csr), cwd=folder)  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert), cwd=folder)  # fmt: skip
    return Pair(cert, key)


def serial(cert: Path) -> str:
    """The certificate's serial number (hex), to tell two certificates apart."""
    out = subprocess.run(["openssl", "x509", "-noout", "-serial", "-in", str(cert)], check=True,
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    return out.strip().split("=", 1)[1]


__all__ = ["Pair", "issue", "make_ca", "serial"]
