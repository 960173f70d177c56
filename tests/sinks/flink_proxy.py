"""A TCP proxy between the Flink sink's committer and the job master that can cut a call in its middle.

The committer is the only client that reaches the master through it, so a chunk of at least
:data:`REQUEST_BYTES` from the client is a call's request (gRPC's own frames on an idle connection,
SETTINGS/PING/WINDOW_UPDATE acks, are 9-17 bytes). :meth:`CutProxy.arm` picks the next such request:
it is forwarded whole, its answer is never forwarded, and then either

- ``"kill"``: the given action runs (the test SIGKILLs the master) while the call is in flight, and the
  client's connection ends the way the master's did (EOF or reset, mirrored as it comes);
- ``"reset"``: the proxy waits for the master's answer (so the call took effect), drops it and resets
  the client's connection (RST): the client cannot know the commit landed.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

REQUEST_BYTES = 80


@dataclass
class _Armed:
    mode: str  # "kill" or "reset"
    action: Callable[[], None]
    fired: threading.Event = field(default_factory=threading.Event)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), not FIN: a connection reset by peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class _Connection:
    def __init__(self, proxy: CutProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.cut: _Armed | None = None  # this connection's call being cut: its answer is not forwarded
        threading.Thread(target=self._requests, daemon=True).start()
        threading.Thread(target=self._answers, daemon=True).start()

    def _requests(self) -> None:
        try:
            while chunk := self.client.recv(65536):
                if len(chunk) >= REQUEST_BYTES and self.cut is None:
                    self.cut = self.proxy._take_armed()
                self.upstream.sendall(chunk)
                if self.cut is not None and self.cut.mode == "kill" and not self.cut.fired.is_set():
                    self.cut.action()  # the master dies with the request in flight
                    self.proxy.cuts.append("kill")
                    self.cut.fired.set()
            self.upstream.shutdown(socket.SHUT_WR)
        except OSError:
            _reset(self.upstream)

    def _answers(self) -> None:
        try:
            while chunk := self.upstream.recv(65536):
                if self.cut is None:
                    self.client.sendall(chunk)
                elif self.cut.mode == "reset":  # the master answered: the commit landed; the client never hears it
                    self.proxy.cuts.append("reset")
                    _reset(self.client)
                    self.upstream.close()
                    self.cut.fired.set()
                    return
            self.client.shutdown(socket.SHUT_WR)  # the master's side ended: so does the client's
            self.client.close()
        except OSError:
            _reset(self.client)


class CutProxy:
    """Listens on 127.0.0.1 (``address``) and forwards each connection to ``upstream()`` (host:port)."""

    def __init__(self, upstream: Callable[[], str]) -> None:
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.cuts: list[str] = []  # the cuts made, in order
        self._lock = threading.Lock()
        self._armed: _Armed | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str, action: Callable[[], None] = lambda: None) -> threading.Event:
        """Cut the next request (``mode`` "kill" runs ``action`` mid-call; "reset"); set once it was cut."""
        assert mode in ("kill", "reset"), mode
        armed = _Armed(mode, action)
        with self._lock:
            self._armed = armed
        return armed.fired

    def disarm(self) -> bool:
        """Take back the armed cut; False when a request already took it (it fires soon)."""
        with self._lock:
            was, self._armed = self._armed is not None, None
        return was

    def _take_armed(self) -> _Armed | None:
        with self._lock:
            armed, self._armed = self._armed, None
        return armed

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            host, port = self.upstream().rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)), timeout=5)
                upstream.settimeout(None)
            except OSError:  # the master is down: the client sees its connection refused, as without the proxy
                _reset(client)
                continue
            _Connection(self, client, upstream)

    def close(self) -> None:
        self.server.close()
