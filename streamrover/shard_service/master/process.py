"""A running job master: the state-dir lock, the journal, the core, the token check and the gRPC server."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from streamrover.shard_service.api import DEFAULT_LEASE_TTL, InvalidArgumentError
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.server import ShardServicer
from streamrover.shard_service.master.statelock import StateDirLock
from streamrover.shard_service.master.web import Dashboard, write_address
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc
from streamrover.tokens import new_token

log = logging.getLogger(__name__)


class _TokenAuth(grpc.ServerInterceptor):
    """Refuse every call that lacks ``authorization: Bearer <token>`` metadata."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: pass the job token the master uses")

        def deny_stream(requests: Any, context: grpc.ServicerContext) -> Any:
            deny(None, context)
            yield from ()

        self._deny: Any = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream: Any = grpc.stream_stream_rpc_method_handler(deny_stream)

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        return self._deny_stream if handler is not None and handler.request_streaming else self._deny


class MasterServer:
    """A running job master: journal, core, servicer and gRPC server."""

    def __init__(
        self,
        state_dir: str | Path,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        durability: str = "normal",
        max_workers: int = 64,
        http_port: int | None = None,
        http_host: str = "127.0.0.1",
        http_fallback: bool = False,
    ) -> None:
        """Start a master on ``host:port`` (0 = a free port); ``http_port`` (0 = a free port) also starts its
        HTTP endpoint (``/metrics`` and the dashboard, :mod:`.web`) on ``http_host``, under the same token;
        ``http_fallback``: if ``http_port`` is taken, a free port instead. Its URL goes to STATE_DIR/dashboard.url."""
        if not token:
            raise InvalidArgumentError("the master needs an auth token")
        self.state_dir = Path(state_dir)
        self.fatal = ""  # set when a journal write failed and the master stopped itself
        self._stopped = threading.Event()
        self._lock = StateDirLock(self.state_dir)  # before the journal is opened: one master per state dir
        try:
            self.journal = Journal(self.state_dir / "journal.db", durability=durability, exclusive=True)
            self.core = ShardCore(self.journal, lease_ttl=lease_ttl)
            # a worker session holds a server thread for its life: keep threads for the unary calls
            sessions = max(max_workers - 16, max_workers // 2)
            self.servicer = ShardServicer(self.core, on_fatal=self._fail_stop, max_sessions=sessions)
        except BaseException:
            self._lock.release()
            raise
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            interceptors=[_TokenAuth(token)],
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_ShardServiceServicer_to_server(self.servicer, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.dashboard: Dashboard | None = None
        if http_port is not None:
            try:
                try:
                    self.dashboard = Dashboard(self.servicer, token, http_host, http_port, durability)
                except OSError as exc:
                    if not http_fallback or http_port == 0:
                        raise OSError(f"cannot serve the dashboard on {http_host}:{http_port}: {exc}") from exc
                    log.warning("dashboard port %d is taken (%s): serving it on a free port", http_port, exc)
                    self.dashboard = Dashboard(self.servicer, token, http_host, 0, durability)
            except BaseException:
                self._server.stop(0)
                self._close_state()
                raise
            write_address(self.state_dir / "dashboard.url", self.dashboard.url)
        self._server.start()
        log.info("shard service listening on %s (state in %s)", self.address, self.state_dir)

    def _fail_stop(self, reason: str) -> None:
        self.fatal = reason
        self.stop(grace=0)
        self._stopped.set()

    def wait(self) -> None:
        """Until the server stops; after a fail-stop, until it has closed everything (then ``fatal`` says why)."""
        self._server.wait_for_termination()
        if self.servicer.fatal:
            self._stopped.wait(30)

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), stop the dashboard, close the journal."""
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
