"""Who may call the master: the two tokens (admin and worker), read from files and reloaded when they change.

The roles and which calls each may make are stated in :mod:`streamrover.shard_service.api` (**Roles**):
the interceptor here refuses a call whose token is wrong (``UNAUTHENTICATED``) or whose role may not make it
(``PERMISSION_DENIED``, naming the call and the role). The servicer asks :meth:`Tokens.role_of` for the two
calls a worker may make in part (``RegisterDataset``, ``Restore``).

A token given as a file is checked at every call (one ``stat``): when the file changes (a rotation, e.g. a
Kubernetes Secret updated in place) the new token holds from the next call on and the old one is refused. A
file caught half-written (empty) keeps the previous token, with a warning. The worker token is the admin
token's :func:`~streamrover.tokens.worker_token` unless one is given, so it rotates with it.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from streamrover.shard_service.api import ADMIN_CALLS, WORKER_CALLS, InvalidArgumentError, Role
from streamrover.tokens import worker_token

log = logging.getLogger(__name__)


class _TokenFile:
    """A token in a file, read again when the file's (mtime, size, inode) change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self.value = ""
        self.fresh()
        if not self.value:
            raise InvalidArgumentError(f"the token file {str(path)!r} is empty or unreadable")

    def fresh(self) -> str:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._stamp is not None:
                log.warning("token file %s: %s; keeping the token read before", self.path, exc.strerror)
            self._stamp = None
            return self.value
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            try:
                value = self.path.read_text().strip()
            except OSError:
                value = ""
            if value:
                if self.value and value != self.value:
                    log.warning("token file %s changed: the new token holds from now on", self.path)
                self.value, self._stamp = value, stamp
            else:
                log.warning("token file %s is empty (being written?): keeping the token read before", self.path)
        return self.value


class Tokens:
    """The admin token and the worker token (each given, or a file reloaded when it changes)."""

    def __init__(
        self,
        admin: str | None = None,
        *,
        admin_file: str | Path | None = None,
        worker: str | None = None,
        worker_file: str | Path | None = None,
    ) -> None:
        self._admin_file = _TokenFile(Path(admin_file)) if admin_file else None
        self._worker_file = _TokenFile(Path(worker_file)) if worker_file else None
        self._admin = admin or ""
        self._worker = worker or ""
        self._lock = threading.Lock()
        self._derived: tuple[tuple[str, str], bytes, bytes] = (("", ""), b"", b"")  # (tokens), their Bearer headers
        if not self.admin:
            raise InvalidArgumentError("the master needs an auth token")

    @property
    def admin(self) -> str:
        """The admin token now."""
        return self._admin_file.fresh() if self._admin_file is not None else self._admin

    @property
    def worker(self) -> str:
        """The worker token now (the admin token's :func:`worker_token` unless one was given)."""
        if self._worker_file is not None:
            return self._worker_file.fresh()
        return self._worker or worker_token(self.admin)

    def _headers(self) -> tuple[bytes, bytes]:
        admin = self.admin
        given = self._worker_file.fresh() if self._worker_file is not None else self._worker
        with self._lock:
            if self._derived[0] != (admin, given):
                worker = given or worker_token(admin)
                self._derived = ((admin, given), f"Bearer {admin}".encode(), f"Bearer {worker}".encode())
            return self._derived[1], self._derived[2]

    def role_of_header(self, header: bytes) -> Role | None:
        """The role of an ``authorization`` header's value (None: no such token). Constant time."""
        admin, worker = self._headers()
        is_admin = hmac.compare_digest(header, admin)
        is_worker = hmac.compare_digest(header, worker)
        return Role.ADMIN if is_admin else Role.WORKER if is_worker else None

    def role_of(self, metadata: Any) -> Role | None:
        """The role of a call's invocation metadata (None: no token, or a wrong one)."""
        for key, value in metadata or ():
            if key == "authorization":
                return self.role_of_header(value.encode() if isinstance(value, str) else value)
        return None


def call_name(method: str) -> str:
    """``/streamrover.shard_service.v1.ShardService/Ack`` -> ``Ack``."""
    return method.rsplit("/", 1)[-1]


class RoleAuth(grpc.ServerInterceptor):
    """Refuse a call without a valid token (UNAUTHENTICATED) or whose role may not make it (PERMISSION_DENIED)."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    @staticmethod
    def _deny(handler: Any, code: grpc.StatusCode, why: str) -> Any:
        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(code, why)

        def deny_stream(requests: Any, context: grpc.ServicerContext) -> Any:
            deny(None, context)
            yield from ()

        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        role = self.tokens.role_of(handler_call_details.invocation_metadata)
        call = call_name(handler_call_details.method)
        if role is Role.ADMIN or (role is Role.WORKER and (call in WORKER_CALLS or call in PARTLY_WORKER)):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if role is None:
            why = "missing or wrong token: pass the job token the master uses"
            return self._deny(handler, grpc.StatusCode.UNAUTHENTICATED, why)
        admin = " (an administrator's call)" if call in ADMIN_CALLS else ""
        why = f"{call}{admin}: the worker role may not make this call; it needs the admin token"
        return self._deny(handler, grpc.StatusCode.PERMISSION_DENIED, why)


#: Administrator's calls a worker may make in part; the servicer checks the request (api.py, **Roles**).
PARTLY_WORKER = frozenset({"RegisterDataset", "Restore"})


def role_in(context: Any, tokens: Tokens | None) -> Role:
    """The role of the call whose servicer context is ``context`` (ADMIN when the master checks no tokens)."""
    if tokens is None:
        return Role.ADMIN
    return tokens.role_of(context.invocation_metadata()) or Role.WORKER


__all__ = ["PARTLY_WORKER", "RoleAuth", "Tokens", "call_name", "role_in"]
