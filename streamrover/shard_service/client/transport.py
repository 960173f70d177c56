"""How a worker client reaches the master: unary calls with retries, and the worker session stream.

:class:`Transport` owns the channel. :meth:`Transport.call` makes one unary call: it waits for
the channel to be ready and retries every transient status (the rule is :mod:`.retry`) with
backoff for up to ``timeout`` seconds, and raises the service's typed errors. :meth:`Transport.worker_call` sends a
worker's per-shard call (lease, ack, ack batch, heartbeat) as a message on one long-lived
``WorkerSession`` stream (:class:`WorkerStream`); the master answers it exactly as the unary
call, and a refusal is raised as the same error. The stream is reopened (and the message sent
again) after a master restart, like a retried unary call: safe, since acks are idempotent per
attempt and lease and batch requests carry request ids. A master that does not serve sessions
(an older build, or one serving as many as it will) is reached by the unary calls instead.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from streamrover.shard_service.api import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ShardServiceError,
    UnauthenticatedError,
    UnavailableError,
)
from streamrover.shard_service.client.retry import FIRST_DELAY, next_delay, transient
from streamrover.shard_service.client.tls import ClientTls, channel
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc

T = TypeVar("T")
log = logging.getLogger(__name__)
ERRORS: dict[grpc.StatusCode, type[ShardServiceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}
ERRORS_BY_NAME: dict[str, type[ShardServiceError]] = {code.name: error for code, error in ERRORS.items()}
_NO_SESSION = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
_BROKEN = -1  # the seq of the answer made up for a stream that broke with a transient status (sent again)


class Transport:
    """The channel to the master and the two ways of calling it."""

    def __init__(
        self, address: str, token: str, timeout: float, session: bool = True, tls: ClientTls | bool | None = True
    ) -> None:
        """``tls``: True (default) = from the environment (:meth:`ClientTls.from_env`); None or False = plaintext."""
        self.address = address
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.enable_retries", 1),
            # a restarted master is found within a second (gRPC's default backoff grows to minutes; leases expire)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.tls = ClientTls.from_env() if tls is True else (tls or None)
        self.channel = channel(address, options, self.tls)
        self.stub = pb_grpc.ShardServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.retries = 0  # calls and session messages sent again after a transient failure (for tests and logs)
        self.statuses: dict[str, int] = {}  # the transient statuses retried, by name
        self._stream = WorkerStream(self) if session else None

    def retried(self, code: str, details: str) -> None:
        """Count a call sent again after transient status ``code`` (kept in :attr:`statuses`; logged at debug)."""
        self.retries += 1
        self.statuses[code] = self.statuses.get(code, 0) + 1
        log.debug("retrying a call of %s after %s: %s", self.address, code, details)

    def error(self, code: str, details: str) -> ShardServiceError:
        """The typed error of a refusal with gRPC status name ``code``."""
        hint = ""
        if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):  # a refused TLS handshake looks like no master at all
            hint = (f" (TLS, verifying the master by {self.tls.ca}: is its certificate signed by that CA, for this"
                    " address?)" if self.tls is not None else
                    " (plaintext: if the master serves TLS, set STREAMROVER_TLS_CA to its CA)")  # fmt: skip
        return ERRORS_BY_NAME.get(code, ShardServiceError)(f"{details} [{code} from {self.address}]{hint}")

    def call(self, method: Callable[..., T], request: Any, timeout: float | None = None, gone: T | None = None) -> T:
        """One unary call, retried on a transient status (:func:`.retry.transient`) until the client's timeout.

        ``timeout``: this call's own deadline (then DEADLINE_EXCEEDED is final). ``gone``: for a call that is not
        idempotent but removes something (:data:`.retry.GUARDED`), the answer when a retry is answered NOT_FOUND
        (the first try removed it, and its answer was lost).
        """
        give_up = time.monotonic() + self.timeout
        delay = FIRST_DELAY
        retried = False
        while True:
            remaining = give_up - time.monotonic()
            try:
                return method(
                    request,
                    metadata=self.metadata,
                    wait_for_ready=True,
                    timeout=max(min(remaining, timeout or remaining), 0.01),
                )
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if transient(code, details, own_deadline=timeout is not None) and time.monotonic() + delay < give_up:
                    time.sleep(delay * (0.5 + random.random()))  # backoff between retries, not synchronisation
                    delay = next_delay(delay)
                    self.retried(code.name, details)
                    retried = True
                    continue
                if retried and gone is not None and code is grpc.StatusCode.NOT_FOUND:
                    return gone
                raise self.error(code.name, details) from None

    def worker_call(self, kind: str, method: Callable[..., T], request: Any) -> T:
        """A worker's per-shard call ``kind`` ("lease", "ack", "ack_batch", "heartbeat") on the session stream.

        ``method`` is the unary call of the same meaning, used when the master serves no session.
        """
        stream = self._stream
        if stream is not None and stream.usable:
            try:
                return stream.call(kind, request)
            except _NoSession:
                pass
        return self.call(method, request)

    @property
    def streaming(self) -> bool:
        """Whether per-shard calls go over the session stream (until the master turns it down)."""
        return self._stream is not None and self._stream.usable

    def close(self) -> None:
        """End the session stream and close the channel."""
        if self._stream is not None:
            self._stream.close()
        self.channel.close()


def _retried(answer: pb.SessionResponse) -> bool:
    """Whether a session answer is sent again: the master's UNAVAILABLE, or a broken stream's transient status."""
    return answer.error_code == "UNAVAILABLE" or (answer.seq == _BROKEN and bool(answer.error_code))


class _NoSession(Exception):
    """The master serves no worker session: use the unary calls."""


class WorkerStream:
    """One ``WorkerSession`` stream; one message in flight at a time (the master answers in order)."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport
        self._lock = threading.Lock()  # held for one request and its answer
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] | None = None
        self._responses: Any = None
        self._seq = 0
        self.usable = True
        self._closed = False
        self._started: float | None = None  # when the message in flight was sent
        self._sent = 0.0  # when the last message was sent
        self._expired = False
        self._watch = threading.Condition()
        self._watchdog: threading.Thread | None = None

    def call(self, kind: str, message: Any) -> Any:
        """Send ``message`` as call ``kind``; its answer, or its refusal raised as the typed error."""
        with self._lock:
            answer = self._try(kind, message)
            if answer is not None and not answer.error_code:  # the fast path: answered at the first try
                return getattr(answer, kind)
            return self._retry(kind, message, answer)

    def _retry(self, kind: str, message: Any, answer: pb.SessionResponse | None) -> Any:
        """After a first try that got no answer or a refusal: raise it, or retry a transient one with backoff.

        The retries end ``timeout`` seconds after the first try was sent (called with the lock held).
        """
        give_up = self._sent + self._t.timeout
        delay = FIRST_DELAY
        while True:
            if answer is not None and not _retried(answer):
                if answer.error_code:
                    raise self._t.error(answer.error_code, answer.error)
                return getattr(answer, kind)
            if time.monotonic() + delay >= give_up:
                code = answer.error_code if answer is not None else "UNAVAILABLE"
                raise self._t.error(code, answer.error if answer is not None else "the master is gone")
            time.sleep(delay * (0.5 + random.random()))  # backoff between retries, not synchronisation
            delay = next_delay(delay)
            self._t.retried(answer.error_code if answer is not None else "UNAVAILABLE",
                            answer.error if answer is not None else "the master ended the stream")  # fmt: skip
            answer = self._try(kind, message)

    def _try(self, kind: str, message: Any) -> pb.SessionResponse | None:
        """One try of ``message`` (called with the lock held): its answer, None if the master ended the stream."""
        if self._closed:
            raise ShardServiceError(f"the client is closed [CANCELLED from {self._t.address}]")
        try:
            return self._once(kind, message)
        except grpc.RpcError as exc:
            return self._failed(exc)

    def _failed(self, exc: grpc.RpcError) -> pb.SessionResponse:
        """The stream broke (it is dropped): its error raised, or for a transient one an answer saying so (retried).

        The stream has no deadline of its own (the watch's cancel is ours): DEADLINE_EXCEEDED here is transient.
        """
        code, details = exc.code(), exc.details() or ""
        expired = self._expired  # the deadline watch cancelled it
        self._reset()
        if code in _NO_SESSION:
            self.usable = False
            raise _NoSession(code.name) from None
        if code == grpc.StatusCode.CANCELLED and expired:
            raise self._t.error("DEADLINE_EXCEEDED", f"no answer within {self._t.timeout}s") from None
        if not transient(code, details):
            raise self._t.error(code.name, details) from None
        return pb.SessionResponse(error_code=code.name, error=details, seq=_BROKEN)

    def _once(self, kind: str, message: Any) -> pb.SessionResponse | None:
        if self._responses is None:
            self._requests = queue.SimpleQueue()
            self._responses = self._t.stub.WorkerSession(
                iter(self._requests.get, None), metadata=self._t.metadata, wait_for_ready=True
            )
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch_deadlines, name="shard-session", daemon=True)
                self._watchdog.start()
        self._seq += 1
        assert self._requests is not None
        self._requests.put(pb.SessionRequest(seq=self._seq, **{kind: message}))
        self._started = self._sent = time.monotonic()
        try:
            answer: pb.SessionResponse = next(self._responses)
        except StopIteration:  # the master ended the stream: as if it had gone away
            self._reset()
            return None
        finally:
            self._started = None
        if answer.seq != self._seq:
            self._reset()
            raise ShardServiceError(f"session answer {answer.seq} to message {self._seq} [INTERNAL]")
        return answer

    def _reset(self) -> None:
        """Drop the stream (a new one opens with the next call)."""
        if self._requests is not None:
            self._requests.put(None)  # ends the request iterator grpc reads in its own thread
        if self._responses is not None:
            self._responses.cancel()
        self._requests = self._responses = None
        self._expired = False

    def _watch_deadlines(self) -> None:
        """Cancel the stream when a message waits for its answer longer than the client's timeout."""
        with self._watch:
            while not self._closed:
                self._watch.wait(max(self._t.timeout / 4, 0.05))  # a deadline check, not synchronisation
                started, responses = self._started, self._responses
                if started is not None and responses is not None and time.monotonic() - started > self._t.timeout:
                    self._expired = True
                    responses.cancel()

    def close(self) -> None:
        """End the stream (the master sees the worker close it) and stop the deadline watch."""
        with self._watch:
            self._closed = True
            self._watch.notify_all()
        if self._requests is not None:
            self._requests.put(None)
        if self._responses is not None:
            self._responses.cancel()


__all__ = ["ERRORS", "ERRORS_BY_NAME", "Transport", "WorkerStream"]
