"""moto's S3 server on loopback, counting the object bytes it serves: the storage's own count
of what a restore read from the durable root.

Each GET of an object (not a bucket listing) is recorded with its time, key and the bytes of
its response body, as the WSGI layer hands them to the client; HEAD, PUT, LIST and multipart
calls are not reads of checkpoint data and are not counted. `object_bytes_read(t0, t1)` is
the sum over the GETs answered in a time window; each read names the trainingd component that
made it (from its User-Agent), so a restore's reads are told from the status page's listing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

Environ = dict[str, Any]
StartResponse = Callable[..., Any]


class ObjectRead(NamedTuple):
    """One object GET the server answered."""

    done_unix: float
    key: str
    num_bytes: int
    component: str
    """The trainingd component named in the request's User-Agent (`trainingd-rank`: a rank's
    checkpoint manager, `trainingd-status`: the status page's listing, `trainingd-agent`: the
    daemon's own checks; `daemon/_storage.py`), or "" when none is."""
    pid: int | None
    """For a rank's read, the rank's pid (`trainingd-rank/<restart>.<pid>`)."""


class _Counting:
    """WSGI middleware recording object GETs."""

    def __init__(self, app: Callable[[Environ, StartResponse], Iterable[bytes]]) -> None:
        self._app = app
        self._lock = threading.Lock()
        self.reads: list[ObjectRead] = []

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterator[bytes]:
        path = str(environ.get("PATH_INFO", ""))
        # `/bucket/key...`: a key has a second path component; a listing has none.
        is_object_get = environ.get("REQUEST_METHOD") == "GET" and "/" in path.strip("/")
        num_bytes = 0
        for chunk in self._app(environ, start_response):
            num_bytes += len(chunk)
            yield chunk
        if is_object_get:
            with self._lock:
                agent = str(environ.get("HTTP_USER_AGENT", ""))
                named = next((w for w in agent.split() if w.startswith("trainingd-")), "")
                component, _, version = named.partition("/")
                pid = version.rpartition(".")[2]
                read = ObjectRead(
                    time.time(),
                    path.strip("/"),
                    num_bytes,
                    component,
                    int(pid) if pid.isdigit() else None,
                )
                self.reads.append(read)

    def snapshot(self) -> list[ObjectRead]:
        with self._lock:
            return list(self.reads)


class CountingS3:
    """moto's threaded S3 server on 127.0.0.1 and a free port, its object reads counted."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        outer = self

        class _Server(ThreadedMotoServer):  # type: ignore[misc]
            def _server_entry(self) -> None:
                from moto.server import (
                    DomainDispatcherApplication,
                    MotoRequestHandler,
                    create_backend_app,
                )
                from werkzeug.serving import make_server

                outer.counter = _Counting(DomainDispatcherApplication(create_backend_app))
                self._server = make_server(
                    self._ip_address,
                    self._port,
                    outer.counter,
                    True,
                    request_handler=MotoRequestHandler,
                )
                self._server_ready_event.set()
                self._server.serve_forever()

        self.counter: _Counting | None = None
        self._server = _Server(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""

    def start(self) -> CountingS3:
        """Serve; returns self."""
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Stop serving."""
        self._server.stop()

    def create_bucket(self, bucket: str) -> None:
        """An empty bucket (boto3 with the test credentials)."""
        import boto3

        from tests.support.s3 import TEST_KEY, TEST_REGION, TEST_SECRET

        boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=TEST_REGION,
            aws_access_key_id=TEST_KEY,
            aws_secret_access_key=TEST_SECRET,
        ).create_bucket(Bucket=bucket)

    def object_reads(self, start_unix: float, end_unix: float) -> list[ObjectRead]:
        """Object GETs answered between `start_unix` and `end_unix`."""
        assert self.counter is not None, "start() first"
        return [r for r in self.counter.snapshot() if start_unix <= r.done_unix <= end_unix]
