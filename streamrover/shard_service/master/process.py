"""A running job master: the state-dir lock, the journal, the core, the token check and the gRPC server."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from pathlib import Path

import grpc

from streamrover.shard_service.api import DEFAULT_LEASE_TTL, InvalidArgumentError
from streamrover.shard_service.master.auth import RoleAuth, Tokens
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.decode import add_servicer
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.server import ShardServicer
from streamrover.shard_service.master.session import DEFAULT_MAX_SESSIONS
from streamrover.shard_service.master.statelock import StateDirLock
from streamrover.shard_service.master.stragglers import DEFAULT_THRESHOLD as STRAGGLER_THRESHOLD
from streamrover.shard_service.master.stragglers import DEFAULT_WINDOW as STRAGGLER_WINDOW
from streamrover.shard_service.master.stragglers import StragglerWatch
from streamrover.shard_service.master.tls import ServerTls, TlsFiles, plaintext_warning
from streamrover.shard_service.master.web import Dashboard, write_address
from streamrover.tokens import new_token

#: The largest request the master reads (gRPC's max_receive_message_length); a larger one is refused
#: RESOURCE_EXHAUSTED before it is parsed, so an oversized call costs no more than this much memory.
MAX_REQUEST_BYTES = 4 << 20

log = logging.getLogger(__name__)


class MasterServer:
    """A running job master: journal, core, servicer and gRPC server."""

    def __init__(
        self,
        state_dir: str | Path,
        token: str | Tokens,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        durability: str = "normal",
        max_workers: int = 64,
        http_port: int | None = None,
        http_host: str = "127.0.0.1",
        http_fallback: bool = False,
        tls: TlsFiles | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        straggler_threshold: float = STRAGGLER_THRESHOLD,
        straggler_window: float = STRAGGLER_WINDOW,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        """Start a master on ``host:port`` (0 = a free port); ``http_port`` (0 = a free port) also starts its
        HTTP endpoint (``/metrics`` and the dashboard, :mod:`.web`) on ``http_host``, under the same token;
        ``http_fallback``: if ``http_port`` is taken, a free port instead. Its URL goes to STATE_DIR/dashboard.url.

        ``token``: the admin token (the worker token is derived from it), or :class:`~.auth.Tokens` (files,
        reloaded when they change). ``tls``: serve gRPC and HTTP over TLS (mutual with a client CA), the
        certificate reloaded when its files change; without it, a master bound off loopback warns in its
        log and status. ``max_request_bytes``: larger requests are refused RESOURCE_EXHAUSTED unread.
        ``straggler_threshold``/``straggler_window``: a node whose busy time per step stays above the threshold
        times the other nodes' median for the window (seconds) is a straggler (:mod:`.stragglers`).
        ``max_workers``: server threads for the unary calls; ``max_sessions``: worker session streams served at
        once, each with a thread of its own on top of those (threads are started as sessions open)."""
        if max_workers < 1 or max_sessions < 0:
            raise InvalidArgumentError(f"max_workers must be >= 1 and max_sessions >= 0: {max_workers}, {max_sessions}")
        if not token:
            raise InvalidArgumentError("the master needs an auth token")
        self.tokens = token if isinstance(token, Tokens) else Tokens(token)
        self.tls = ServerTls(tls) if tls is not None else None
        self.state_dir = Path(state_dir)
        self.fatal = ""  # set when a journal write failed and the master stopped itself
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._closed = False
        self._lock = StateDirLock(self.state_dir)  # before the journal is opened: one master per state dir
        try:
            self.journal = Journal(self.state_dir / "journal.db", durability=durability, exclusive=True)
            self.core = ShardCore(self.journal, lease_ttl=lease_ttl)
            # a worker session holds a server thread for its life: each gets one on top of the unary calls' threads
            self.servicer = ShardServicer(
                self.core, on_fatal=self._fail_stop, max_sessions=max_sessions, tokens=self.tokens,
                on_stop=self._stop_rpc, stragglers=StragglerWatch(straggler_threshold, straggler_window),
            )  # fmt: skip
        except BaseException:
            self._lock.release()
            raise
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers + max_sessions, thread_name_prefix="rpc"),
            interceptors=[RoleAuth(self.tokens)],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_request_bytes)],
        )
        add_servicer(self.servicer, self._server)  # garbage bytes: INVALID_ARGUMENT, not gRPC's INTERNAL
        if self.tls is not None:
            self.port = self._server.add_secure_port(f"{host}:{port}", self.tls.grpc_credentials())
        else:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"
        bound = [host, http_host] if http_port is not None else [host]
        self.security_warning = "" if self.tls is not None else plaintext_warning(bound)
        self.servicer.security_warning = self.security_warning
        if self.security_warning:
            log.warning("%s", self.security_warning)
        self.dashboard: Dashboard | None = None
        ssl_ctx = self.tls.http_context() if self.tls is not None else None
        if http_port is not None:
            try:
                try:
                    self.dashboard = Dashboard(self.servicer, self.tokens, http_host, http_port, durability, ssl_ctx)
                except OSError as exc:
                    if not http_fallback or http_port == 0:
                        raise OSError(f"cannot serve the dashboard on {http_host}:{http_port}: {exc}") from exc
                    log.warning("dashboard port %d is taken (%s): serving it on a free port", http_port, exc)
                    self.dashboard = Dashboard(self.servicer, self.tokens, http_host, 0, durability, ssl_ctx)
            except BaseException:
                self._server.stop(0)
                self._close_state()
                raise
            write_address(self.state_dir / "dashboard.url", self.dashboard.url)
        self._server.start()
        tls_note = "TLS" + (" with client certificates" if tls and tls.client_ca else "") if tls else "plaintext"
        log.info("shard service listening on %s, %s (state in %s)", self.address, tls_note, self.state_dir)

    def _stop_rpc(self, reason: str) -> None:
        """The Stop call (admin only), after its answer: stop serving as a signal would."""
        log.warning("stopping: asked by an administrator (%s)", reason or "no reason given")
        self.stop(grace=1.0)
        self._stopped.set()

    def _fail_stop(self, reason: str) -> None:
        self.fatal = reason
        self.stop(grace=0)
        self._stopped.set()

    def wait(self) -> None:
        """Until the server stops; after a fail-stop, until it has closed everything (then ``fatal`` says why)."""
        self._server.wait_for_termination()
        if self.servicer.fatal or self.servicer.stopping:
            self._stopped.wait(30)

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), stop the dashboard, close the journal (once)."""
        with self._stop_lock:
            if self._closed:
                return
            self._closed = True
        self._server.stop(grace).wait()
        if self.dashboard is not None:
            self.dashboard.stop()
        self._close_state()

    def _close_state(self) -> None:
        self.servicer.close()
        self.journal.close()
        self._lock.release()


def load_or_create_token(state_dir: Path) -> str:
    """The token in ``state_dir/token`` (mode 0600), created on first use."""
    path = state_dir / "token"
    if path.exists():
        return path.read_text().strip()
    state_dir.mkdir(parents=True, exist_ok=True)
    token = new_token()
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


__all__ = ["MasterServer", "load_or_create_token"]
