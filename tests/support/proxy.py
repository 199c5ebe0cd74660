"""A slow network for tests: a TCP proxy on loopback that throttles what clients send.

Put it between a client and a loopback server (moto, SeaweedFS) to make an upload take
seconds, so that a test can act while it is in flight (kill the writer mid-upload), or to
drop one connection mid-request. Both directions are forwarded; only client-to-server bytes
are throttled (or cut). A connection whose client goes away is closed on the server side
too, as a real network would.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit

__all__ = ["ThrottledProxy"]

_PIECE = 64 << 10


class ThrottledProxy:
    """Forwards 127.0.0.1:<port> to `target_url`'s host and port.

    Client-to-server bytes go at most `bytes_per_s` (0: unthrottled); with
    `cut_once_after_bytes`, the first connection that sends more than that is dropped
    mid-request (once), like a network blip.
    """

    def __init__(
        self, target_url: str, bytes_per_s: float = 0.0, *, cut_once_after_bytes: int = 0
    ) -> None:
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", int(parts.port or 80))
        self._bytes_per_s = bytes_per_s
        self._cut_after = cut_once_after_bytes  # 0: never
        self.num_cut = 0
        """Connections cut mid-request so far (at most one)."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        """The proxy's URL, to use as the client's endpoint."""
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    def __enter__(self) -> ThrottledProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Close the listener and every connection."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
        self._thread.join(timeout=5)

    def _cut_here(self, sent: int) -> bool:
        with self._lock:
            if not self._cut_after or sent <= self._cut_after:
                return False
            self._cut_after = 0
            self.num_cut += 1
            return True

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            for src, dst, upstream in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(_PIECE)
                if not data:
                    break
                sent += len(data)
                if upstream and self._cut_here(sent):
                    break  # drop the connection mid-request, once
                dst.sendall(data)
                if upstream and self._bytes_per_s > 0:
                    time.sleep(len(data) / self._bytes_per_s)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
