"""A slow network for tests: a TCP proxy on loopback that throttles what clients send.

Put it between a client and a loopback server (moto, SeaweedFS) to make an upload take
seconds, so that a test can act while it is in flight (kill the writer mid-upload). Both
directions are forwarded; only client-to-server bytes are throttled. A connection whose
client goes away is closed on the server side too, as a real network would.
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
    """Forwards 127.0.0.1:<port> to `target_url`'s host and port, uploads at `bytes_per_s`."""

    def __init__(self, target_url: str, bytes_per_s: float) -> None:
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", int(parts.port or 80))
        self._bytes_per_s = bytes_per_s
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
            for src, dst, rate in ((client, server, self._bytes_per_s), (server, client, 0.0)):
                threading.Thread(target=self._pump, args=(src, dst, rate), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bytes_per_s: float) -> None:
        try:
            while True:
                data = src.recv(_PIECE)
                if not data:
                    break
                dst.sendall(data)
                if bytes_per_s > 0:
                    time.sleep(len(data) / bytes_per_s)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
