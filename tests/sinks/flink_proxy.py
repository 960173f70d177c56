"""A TCP proxy between the Flink sink's committer and the job master that can cut a call in its middle.

The committer is the only client that reaches the master through it, and makes unary calls only: a chunk
from the client with a DATA frame that ends its stream is the end of a call's request. :meth:`CutProxy.arm`
picks the next such request: it is forwarded whole, its answer is never forwarded, and then either

- ``"kill"``: the given action runs (the test SIGKILLs the master) while the call is in flight, and the
  client's connection ends the way the master's did (EOF or reset, mirrored as it comes);
- ``"kill-garble"``: the same, and the client reads a garbled HTTP/2 frame before the connection ends;
- ``"reset"``: the proxy waits for the master's whole successful answer (so the call took effect), drops
  it and resets the client's connection (RST): the client cannot know the commit landed;
- ``"garble"``: the same, with a garbled frame in place of the trailers.

What grpc-java 1.85 reports for each (seen in tests/sinks/test_flink_committer.py): a master killed
mid-call, UNAVAILABLE ("Network closed for unknown reason" on its FIN, "io exception" on its RST); a
reset, UNAVAILABLE ("io exception"); an answer without its trailers then FIN or RST, UNAVAILABLE; a
garbled frame, INTERNAL ("http2 exception"). grpc-java's UNKNOWN "channel closed" (a write racing the
connection's close, as seen with a master killed directly) could not be produced on demand through a proxy.

With ``tls`` (issue 33) the proxy terminates the committer's TLS with the master's own certificate files (read
at each connection, so a certificate swapped in place is served at the next handshake, as the master does) and
speaks TLS to the master, verifying it against the CA: it reads the same HTTP/2 frames in between. TLS runs
over memory BIOs, so the selector still sees the raw sockets and a cut is still a real FIN or RST.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a client's connection starts with
#: an HTTP/2 DATA frame header on stream 1 claiming 16 MiB, more than any peer's SETTINGS_MAX_FRAME_SIZE
GARBLED_FRAME = bytes([0xFF, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01])


@dataclass
class _Armed:
    mode: str  # "kill", "kill-garble", "reset" or "garble"
    action: Callable[[], None]
    fired: threading.Event = field(default_factory=threading.Event)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), not FIN: a connection reset by peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def _frames(chunk: bytes) -> list[tuple[int, int, int]]:
    """(offset, type, flags) of the HTTP/2 frames in ``chunk``, after the connection preface if it starts so.

    It assumes ``chunk`` starts at a frame's start: true of the small writes of a unary call, each made at
    once (a chunk that does not is misread, and at worst a cut waits for the next call)."""
    out = len(PREFACE) if chunk.startswith(PREFACE) else 0
    frames = []
    while out + 9 <= len(chunk):
        frames.append((out, chunk[out + 3], chunk[out + 4]))
        out += 9 + int.from_bytes(chunk[out : out + 3], "big")
    return frames


def _ends_a_request(chunk: bytes) -> bool:
    """Whether the client's ``chunk`` holds a DATA frame with END_STREAM: the end of a unary call's request."""
    return any(kind == 0 and flags & 1 for _, kind, flags in _frames(chunk))


def _is_an_answer(chunk: bytes) -> bool:
    """Whether the master's ``chunk`` holds a whole successful unary answer: a message (DATA) and trailers.

    (An error is answered by trailers alone.)"""
    frames = _frames(chunk)
    return any(kind == 0 for _, kind, _ in frames) and any(kind == 1 and flags & 1 for _, kind, flags in frames)


def _without_trailers(chunk: bytes) -> bytes:
    """The HTTP/2 frames of the master's ``chunk`` before the first HEADERS frame that ends its stream (trailers)."""
    for offset, kind, flags in _frames(chunk):
        if kind == 1 and flags & 1:
            return chunk[:offset]
    return chunk


@dataclass(frozen=True)
class ProxyTls:
    """The master's certificate files (served to the committer) and the CA the master is verified against."""

    cert: str
    key: str
    ca: str

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["h2"])  # grpc-java insists on ALPN h2
        for attempt in range(3):  # a swap between the two renames pairs a new key with the old certificate
            try:
                ctx.load_cert_chain(self.cert, self.key)
                break
            except ssl.SSLError:
                if attempt == 2:
                    raise
                threading.Event().wait(0.05)  # (pacing a re-read of files being replaced, not a synchronisation)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.set_alpn_protocols(["h2"])
        return ctx


class _Plain:
    """A raw socket's side of a connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ended = False  # the peer ended its side with what the last recv gave (TLS close_notify)

    def handshake(self) -> None:
        pass

    def buffered(self) -> bool:
        return False

    def recv(self) -> bytes | None:
        """What arrived (b"" at the peer's end; raises OSError on a reset)."""
        return self.sock.recv(65536)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)


class _Tls(_Plain):
    """TLS over a raw socket through memory BIOs: ``recv`` after the socket is readable gives the plaintext that
    arrived (None: none yet, a partial record)."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool) -> None:
        super().__init__(sock)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        hostname = None if server_side else "127.0.0.1"
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=server_side, server_hostname=hostname)

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.sock.sendall(data)

    def handshake(self) -> None:
        while True:
            try:
                self.obj.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionResetError("the peer closed during the TLS handshake") from None
                self.incoming.write(data)

    def buffered(self) -> bool:
        """Records that arrived with the handshake's last flight and wait in the BIO (no socket event comes)."""
        return self.incoming.pending > 0

    def recv(self) -> bytes | None:
        if not self.buffered():
            data = self.sock.recv(65536)
            if not data:
                return b""
            self.incoming.write(data)
        plain = []
        try:
            while chunk := self.obj.read(65536):
                plain.append(chunk)
            # b"": the peer's close_notify (CPython's read answers b"" then, again at every call, not
            # SSLZeroReturnError: a loop that kept appending grew one list to 21 GB in a CI rehearsal)
            self.ended = True
            return b"".join(plain) or b""
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:  # close_notify: the peer's end
            self.ended = True
            return b"".join(plain) or b""
        self._flush()  # (post-handshake messages: TLS 1.3 session tickets, key updates)
        return b"".join(plain) or None

    def sendall(self, data: bytes) -> None:
        self.obj.write(data)
        self._flush()


class _Connection:
    """One proxied connection, pumped both ways by one thread (so that a close is a real close: RST or FIN)."""

    def __init__(self, proxy: CutProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.client_side, self.upstream_side = _Plain(client), _Plain(upstream)
        self.cut: _Armed | None = None  # this connection's call being cut: its answer is not forwarded
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:  # the client's handshake, then the master's (each blocking, before any frame is pumped)
            if (tls := self.proxy.tls) is not None:
                self.client_side = _Tls(self.client, tls.server_context(), True)
                self.upstream_side = _Tls(self.upstream, tls.client_context(), False)
            self.client_side.handshake()
            self.upstream_side.handshake()
        except (OSError, ssl.SSLError):  # a handshake refused or cut: the connection ends as the master's would
            _reset(self.client)
            _reset(self.upstream)
            return
        for side, handle in ((self.client_side, self._request), (self.upstream_side, self._answer)):
            if side.buffered() and not handle():  # (a client may send data in its handshake's last flight)
                return
        with selectors.DefaultSelector() as sel:
            sel.register(self.client, selectors.EVENT_READ, self._request)
            sel.register(self.upstream, selectors.EVENT_READ, self._answer)
            open_ = True
            while open_:
                for key, _ in sel.select():
                    if not key.data():
                        open_ = False
                        break

    def _request(self) -> bool:
        try:
            chunk = self.client_side.recv()
            if chunk is None:  # a partial TLS record
                return True
            if not chunk:  # the client closed
                self.upstream.close()
                self.client.close()
                return False
            if self.cut is None and _ends_a_request(chunk):
                self.cut = self.proxy._take_armed()
            self.upstream_side.sendall(chunk)
            if self.cut is not None and self.cut.mode.startswith("kill") and not self.cut.fired.is_set():
                self.cut.action()  # the master dies with the request in flight
                if self.cut.mode == "kill-garble":  # and the client reads garbage before the connection's end
                    self.client_side.sendall(GARBLED_FRAME)
                self.proxy.cuts.append(self.cut.mode)
                self.cut.fired.set()
            if self.client_side.ended:  # close_notify came with the last data: the client's end follows it
                self.upstream.close()
                self.client.close()
                return False
            return True
        except (OSError, ssl.SSLError):
            _reset(self.upstream)
            _reset(self.client)
            return False

    def _answer(self) -> bool:
        try:
            chunk = self.upstream_side.recv()
        except (OSError, ssl.SSLError):  # the master's side was reset: so is the client's
            _reset(self.client)
            self.upstream.close()
            return False
        if chunk is None:  # a partial TLS record
            return True
        if not chunk:  # the master's side ended (FIN): so does the client's
            self.client.close()
            self.upstream.close()
            return False
        if self.cut is None or (self.cut.mode in ("reset", "garble") and not _is_an_answer(chunk)):
            try:  # (a cut waits for a whole answer with a message, a success; pings, settings, errors pass)
                self.client_side.sendall(chunk)
            except (OSError, ssl.SSLError):
                _reset(self.upstream)
                self.client.close()
                return False
            if self.upstream_side.ended:  # close_notify came with the last data: the master's end follows it
                self.client.close()
                self.upstream.close()
                return False
            return True
        if self.cut.mode in ("reset", "garble"):  # the master answered: the commit landed
            if self.cut.mode == "garble":  # the answer but its trailers, then a frame header that is garbage
                self.client_side.sendall(_without_trailers(chunk) + GARBLED_FRAME)
            self.proxy.cuts.append(self.cut.mode)
            _reset(self.client)
            self.upstream.close()
            self.cut.fired.set()
            return False
        return True  # "kill": the answer (if any came before the kill) is dropped


class CutProxy:
    """Listens on 127.0.0.1 (``address``) and forwards each connection to ``upstream()`` (host:port), through TLS
    on both sides with ``tls``."""

    def __init__(self, upstream: Callable[[], str], tls: ProxyTls | None = None) -> None:
        self.upstream = upstream
        self.tls = tls
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.cuts: list[str] = []  # the cuts made, in order
        self._lock = threading.Lock()
        self._armed: _Armed | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str, action: Callable[[], None] = lambda: None) -> threading.Event:
        """Cut the next request (``mode`` "kill" runs ``action`` mid-call; "reset"); set once it was cut."""
        assert mode in ("kill", "kill-garble", "reset", "garble"), mode
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
