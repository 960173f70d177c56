"""The master's HTTP endpoint beside its gRPC port: Prometheus ``/metrics``, a JSON view and the live dashboard.

Served by the standard library's WSGI server (one thread per request), bound to 127.0.0.1 by default.
Every data path needs a job token (admin or worker) as ``Authorization: Bearer <token>`` (the same tokens as
the gRPC calls); without it the answer is 401. Started with TLS, it serves HTTPS with the same certificate
(and, with a client CA, asks for a client certificate). The page itself (``/``) is static and holds no data:
it takes the token from the URL fragment (``/#token=...``, which a browser never sends to the server, so it is never
in a log) or from its login form, keeps it in the tab's session storage, and sends it as that header.
The token is never logged; request lines are not logged at all.

Paths: ``/`` the dashboard, ``/metrics`` Prometheus text (prometheus-client's exposition, so
``Accept: application/openmetrics-text`` and gzip work as in any client), ``/api/v1/metrics`` the same
families as JSON plus the trainer metrics' history (what the page draws), ``/healthz`` (no token).
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import ssl
import threading
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from streamrover.shard_service.master.info import DEFAULT_STATUS_PARTITIONS
from streamrover.shard_service.master.metrics import job_registry

if TYPE_CHECKING:
    from streamrover.shard_service.master.auth import Tokens
    from streamrover.shard_service.master.server import ShardServicer

log = logging.getLogger(__name__)
StartResponse = Callable[..., Any]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS: the handshake in the request's own thread (a slow client holds up no other)."""
        if self.ssl_context is None:
            return super().finish_request(request, client_address)
        try:
            tls = self.ssl_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("dashboard: TLS handshake with %s failed: %s", client_address, exc)
            return None
        try:
            return super().finish_request(tls, client_address)
        finally:
            tls.close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Request lines are not logged (a query string could carry anything)."""


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Dashboard:
    """The HTTP endpoint of one master: started on construction, stopped by :meth:`stop`."""

    def __init__(
        self,
        servicer: ShardServicer,
        tokens: Tokens,
        host: str = "127.0.0.1",
        port: int = 0,
        durability: str = "normal",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._servicer = servicer
        self._tokens = tokens
        self.registry = job_registry(servicer, durability)
        self._metrics_app = make_wsgi_app(self.registry)
        self._page = resources.files("streamrover.shard_service.master").joinpath("dashboard.html").read_bytes()
        self._server = make_server(host, port, self._app, server_class=_Server, handler_class=_QuietHandler)
        self._server.ssl_context = ssl_context
        self.port = self._server.server_port
        self.address = f"{host}:{self.port}"
        self.url = f"{'https' if ssl_context is not None else 'http'}://{self.address}/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        log.info("dashboard and /metrics on %s", self.url)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ WSGI
    def _authorized(self, environ: dict[str, Any]) -> bool:
        got = environ.get("HTTP_AUTHORIZATION", "").encode()
        return self._tokens.role_of_header(got) is not None  # either role may read

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", b"only GET\n", [("Allow", "GET, HEAD")])
        if path in ("/", "/index.html"):
            return _answer(start_response, "200 OK", self._page, [("Content-Type", "text/html; charset=utf-8")])
        if path == "/healthz":
            return _answer(start_response, "200 OK", b"ok\n")
        if path not in ("/metrics", "/api/v1/metrics"):
            return _answer(start_response, "404 Not Found", f"no such path: {path}\n".encode())
        if not self._authorized(environ):
            return _answer(
                start_response,
                "401 Unauthorized",
                b"missing or wrong token: send Authorization: Bearer <the job token> (STATE_DIR/token)\n",
                [("WWW-Authenticate", 'Bearer realm="streamrover"')],
            )
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        query = parse_qs(environ.get("QUERY_STRING", ""))
        since, shown = query.get("since", ["0"])[0], query.get("partitions", [str(DEFAULT_STATUS_PARTITIONS)])[0]
        try:
            since_t = float(since)
        except ValueError:
            return _answer(start_response, "400 Bad Request", f"since={since!r}: give unix seconds\n".encode())
        if shown != "all" and not (shown.isdigit() and int(shown) > 0):
            return _answer(start_response, "400 Bad Request", f"partitions={shown!r}: give N > 0 or all\n".encode())
        body = json.dumps(self.snapshot(since_t, 0 if shown == "all" else int(shown)), allow_nan=False).encode()
        return _answer(start_response, "200 OK", body, [("Content-Type", "application/json")])

    def snapshot(self, since: float = 0.0, partitions: int = 0) -> dict[str, Any]:
        """The metric families now (as JSON-able dicts) and the trainer metrics reported after ``since``.

        ``partitions`` > 0: the per-partition lag keeps each dataset's ``partitions`` most lagging partitions
        (``partition_counts``: how many each dataset has), so that a 10,000-partition topic is not sent whole.
        """
        families = []
        for family in self.registry.collect():
            samples = [
                {"name": s.name, "labels": s.labels, "value": _finite(s.value)} for s in family.samples
            ]
            families.append({"name": family.name, "type": family.type, "help": family.documentation,
                             "samples": samples})  # fmt: skip
        history = {
            reporter: {name: [[p.time, p.step, _finite(p.value)] for p in points] for name, points in series.items()}
            for reporter, series in self._servicer.reported.history(since).items()
        }
        return {"families": families, "trainer_history": history, "partition_counts": _top(families, partitions)}


def _top(families: list[dict[str, Any]], limit: int) -> dict[str, int]:
    """Cut the partition lag family's samples to each dataset's ``limit`` most lagging (0: all, in place);
    returns every dataset's partition count."""
    counts: dict[str, int] = {}
    for family in families:
        if family["name"] != "streamrover_partition_lag_records":
            continue
        by_dataset: dict[str, list[dict[str, Any]]] = {}
        for sample in family["samples"]:
            by_dataset.setdefault(sample["labels"]["dataset"], []).append(sample)
        counts = {name: len(samples) for name, samples in by_dataset.items()}
        if limit:
            family["samples"] = [
                sample for samples in by_dataset.values()
                for sample in heapq.nsmallest(limit, samples, key=lambda x: -(x["value"] or 0))
            ]  # fmt: skip
    return counts


def _answer(
    start_response: StartResponse, status: str, body: bytes, headers: list[tuple[str, str]] | None = None
) -> list[bytes]:
    merged = {"Content-Type": "text/plain; charset=utf-8", "Cache-Control": "no-store", **dict(headers or [])}
    start_response(status, list(merged.items()))
    return [body]


def write_address(path: Path, url: str) -> None:
    """Write the dashboard's URL to ``path`` atomically (for tools that start a master)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(url + "\n")
    tmp.rename(path)


__all__ = ["Dashboard", "write_address"]
