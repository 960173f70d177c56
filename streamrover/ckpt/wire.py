"""Messages between a trainer and its saver: JSON over a Unix SOCK_SEQPACKET socket.

The socket is in Linux's abstract namespace (no file to clean up). SEQPACKET keeps
message boundaries and reports the peer's death as EOF, which is how a saver learns
that its trainer died: no heartbeat, no polling.

Trainer -> saver: ``hello`` (who and where), ``persist`` (a buffer and the generation
to write), ``close``. Saver -> trainer: ``ready``, ``done`` (one per persist), ``closed``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any

MAX_MESSAGE = 1 << 20


def namespace_for(url: str, job: str | None = None) -> str:
    """A short, stable name for a checkpoint root (and job) on this node."""
    root = url if "://" in url else os.path.abspath(url)
    digest = hashlib.sha256(f"{job or ''}\0{root}".encode()).hexdigest()[:16]
    return f"{job}-{digest}" if job else digest


_MAX_ADDRESS = 107  # sun_path is 108 bytes on Linux; an abstract address uses them all but none for a terminator


def saver_address(namespace: str) -> str:
    """The abstract socket address of the saver serving ``namespace`` on this node.

    Namespaces hold the job name (run id and node id: a Kubernetes pod name alone can be 63
    characters), so a long one is replaced by its digest to fit a Unix socket address.
    """
    address = f"\0streamrover-ckpt-{namespace}"
    if len(address.encode()) > _MAX_ADDRESS:
        address = f"\0streamrover-ckpt-{hashlib.sha256(namespace.encode()).hexdigest()[:40]}"
    return address


def send(sock: socket.socket, kind: str, **fields: Any) -> None:
    """Send one message of ``kind`` with ``fields`` (JSON, one packet); ``ValueError`` when over ``MAX_MESSAGE``
    bytes.
    """
    blob = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
    if len(blob) > MAX_MESSAGE:
        raise ValueError(f"saver message {kind!r} is {len(blob)} bytes, over {MAX_MESSAGE}")
    sock.send(blob)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer has closed or died."""
    try:
        blob = sock.recv(MAX_MESSAGE)
    except (ConnectionResetError, BrokenPipeError):
        return None
    if not blob:
        return None
    msg: dict[str, Any] = json.loads(blob)
    return msg


def listen(address: str) -> socket.socket:
    """Bind ``address``; raises OSError(EADDRINUSE) if another saver already serves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def connect(address: str) -> socket.socket:
    """A socket connected to the saver at ``address`` (a Unix SOCK_SEQPACKET socket)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock
