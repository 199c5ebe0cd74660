"""One HTTP port per node: `/` (status page), `/api/status`, `/metrics`, `/healthz`, `/readyz`.

A single WSGI callable dispatches on the path (prometheus_client's own server would serve the
registry on every path and bind 0.0.0.0). `/healthz` is 200 while the supervisor loop beats and
no local rank's training-loop heartbeat is older than `heartbeat_timeout_s` (a long save is not
death: ranks beat on phase changes too, and the timeout is generous; a restore beats on every
read from storage, so only one stuck on storage goes stale); `/readyz` is
200 once rendezvous and restore are done and the node is training, 503 while starting, loading
or draining. Bodies are small JSON objects. The server runs on one daemon thread owned by
`MetricsServer`; `port` 0 binds a free port (`server.port` tells which). `/` is the status page
(`daemon/agent/status_page.py`), which reads `/api/status` (`StatusBoard.snapshot`); without a board
`/api/status` lists the endpoints only.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from daemon.agent.scrapes import ScrapeTracker
from daemon.agent.status_page import PAGE
from daemon.observe.state import ENDED_PHASES, NodeState

_ENDPOINTS = ["/", "/api/status", "/metrics", "/healthz", "/readyz"]

__all__ = ["MetricsServer", "health"]

_SUPERVISOR_STALE_S = 30.0


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not news; errors surface as status codes."""


def health(
    state: NodeState,
    rank_heartbeats: Callable[[], list[float]],
    heartbeat_timeout_s: float,
    now: float | None = None,
) -> tuple[bool, dict[str, Any]]:
    """Liveness verdict and its JSON body.

    Args:
        state: the node state (supervisor heartbeat).
        rank_heartbeats: returns the last heartbeat Unix time of each running local rank.
        heartbeat_timeout_s: largest acceptable rank heartbeat age.
        now: Unix time (tests).
    """
    now = time.time() if now is None else now
    status = state.status()
    supervisor_age = now - status.heartbeat_unix_s
    ages = [now - t for t in rank_heartbeats()]
    oldest = max(ages, default=0.0)
    ok = supervisor_age < _SUPERVISOR_STALE_S and oldest < heartbeat_timeout_s
    body = {
        "ok": ok,
        "state": status.phase.value,
        "supervisor_heartbeat_age_s": round(supervisor_age, 3),
        "oldest_rank_heartbeat_age_s": round(oldest, 3),
        "step": status.step,
    }
    return ok, body


class MetricsServer:
    """Serves the registry and the health endpoints on one port, from a daemon thread.

    Args:
        registry: what `/metrics` exposes.
        state: node state for `/readyz` and `/healthz`.
        rank_heartbeats: last heartbeat of each running local rank (for `/healthz`).
        heartbeat_timeout_s: `/healthz` fails beyond this rank heartbeat age.
        host: bind address (127.0.0.1 unless configured otherwise).
        port: bind port; 0 picks a free one.
        status: the body of `/api/status` (`StatusBoard.snapshot`), or None.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        state: NodeState,
        rank_heartbeats: Callable[[], list[float]],
        *,
        heartbeat_timeout_s: float,
        host: str = "127.0.0.1",
        port: int = 0,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._status = status
        self.scrapes = ScrapeTracker()
        """Every answered `/metrics` request (the wait for a final scrape reads it)."""
        self._metrics_app = make_wsgi_app(registry)
        self._state = state
        self._rank_heartbeats = rank_heartbeats
        self._timeout_s = heartbeat_timeout_s
        self._server = make_server(
            host, port, self._app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self.host = host
        """Bound address."""
        self.port = int(self._server.server_port)
        """Bound port (the free one picked when 0 was asked)."""
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="trainingd-http",
            daemon=True,
        )

    def start(self) -> MetricsServer:
        """Start serving; returns self."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving and release the port."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=timeout_s)
        self._server.server_close()

    def _answered(self, body: Iterable[bytes], began_finished: bool) -> Iterator[bytes]:
        """The body, with the scrape recorded once its bytes went out (wsgiref writes each
        chunk before asking for the next): a daemon that exits on `served` cuts no reply."""
        yield from body
        self.scrapes.served(began_finished=began_finished)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            # Read before the collect: a scrape that began after the end reports it.
            began_finished = self._state.status().phase in ENDED_PHASES
            return self._answered(self._metrics_app(environ, start_response), began_finished)
        if path in ("/healthz", "/livez"):
            ok, body = health(self._state, self._rank_heartbeats, self._timeout_s)
            return _json(start_response, ok, body)
        if path == "/readyz":
            status = self._state.status()
            body = {"ready": status.ready, "state": status.phase.value, "step": status.step}
            return _json(start_response, status.ready, body)
        if path == "/api/status":
            body = self._status() if self._status is not None else {"endpoints": _ENDPOINTS}
            return _json(start_response, True, body)
        if path in ("/", "/index.html"):
            page = PAGE.encode()
            start_response(
                "200 OK",
                [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(page)))],
            )
            return [page]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found; try /, /api/status, /metrics, /healthz or /readyz\n"]


def _json(start_response: Callable[..., Any], ok: bool, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode() + b"\n"
    status = "200 OK" if ok else "503 Service Unavailable"
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    )
    return [data]
