"""A TCP proxy that cuts a gRPC call in the middle: the connection is reset as its request or its answer passes.

Between a client and the master, ``CutProxy`` forwards bytes both ways and reads the HTTP/2 frames as they
pass. Armed with :meth:`CutProxy.arm`, it resets the connection (an RST: SO_LINGER 0) at the next DATA frame
of a call:

- ``"answer"``: the next DATA frame from the master. The master has run the call (a unary handler answers
  with its message in one DATA frame; a session stream's answer is one), and the client never gets the answer:
  the case where a retry must be answered as the first try was.
- ``"request"``: the next DATA frame from the client. The master never sees the call.

Connections made after the cut pass through untouched (until armed again).
"""

from __future__ import annotations

import socket
import struct
import threading

from tests.brokers._process import free_port

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA = 0


class CutProxy:
    """Proxy ``127.0.0.1:<port>`` -> ``target`` (host:port) that can cut a call mid-flight."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._armed: str | None = None
        self.cut = threading.Event()  # set when an armed cut happened
        self.cuts = 0
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="cutproxy-accept", daemon=True).start()

    def arm(self, where: str) -> threading.Event:
        """Cut at the next call's ``where`` ("answer" or "request"); returns the event set when it happened."""
        assert where in ("answer", "request"), where
        with self._lock:
            self._armed = where
            self.cut = threading.Event()
        return self.cut

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(pair, client, upstream, "request"), daemon=True).start()
            threading.Thread(target=self._pump, args=(pair, upstream, client, "answer"), daemon=True).start()

    def _pump(self, pair: tuple[socket.socket, socket.socket], src: socket.socket, dst: socket.socket,
              direction: str) -> None:  # fmt: skip
        buf = b""
        preface = direction == "request"
        while True:
            try:
                chunk = src.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._close(pair, reset=False)
                return
            buf += chunk
            if preface:
                if len(buf) < len(_PREFACE):
                    continue
                dst.sendall(buf[: len(_PREFACE)])
                buf = buf[len(_PREFACE) :]
                preface = False
            while len(buf) >= 9:  # whole frames only: a cut falls between frames
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind = buf[3]
                stream = struct.unpack(">I", buf[5:9])[0] & 0x7FFFFFFF
                with self._lock:
                    hit = self._armed == direction and kind == _DATA and stream > 0 and length > 0
                    if hit:
                        self._armed = None
                        self.cuts += 1
                if hit:
                    self._close(pair, reset=True)
                    self.cut.set()
                    return
                try:
                    dst.sendall(buf[: 9 + length])
                except OSError:
                    self._close(pair, reset=False)
                    return
                buf = buf[9 + length :]

    @staticmethod
    def _close(pair: tuple[socket.socket, socket.socket], reset: bool) -> None:
        for s in pair:
            try:
                if reset:  # an RST at close, not a FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # now, even while the other pump's recv holds the socket
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        self._server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.close()
            except OSError:
                pass
