"""Trainer side of a writer process: start, feed, poll, stop or kill it.

One `WriterProcess` is owned by one manager (persistent mode: for the whole run, replaced if it
dies; temporal mode: one per save). Requests go out from the staging thread, responses are
read on the training thread in `maybe_finalize()`; each direction has its own lock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from ckpt_manager._save.staging import Slab

__all__ = ["WriterProcess"]


class WriterProcess:
    """A running writer subprocess (`python -m ckpt_manager._save.writer`)."""

    def __init__(self, rank: int) -> None:
        """Start the process; returns without waiting for it to import anything."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn = Connection(parent_sock.detach())
        child_fd = child_sock.detach()
        # One thread is enough to move bytes; don't let BLAS-style pools fight the trainer.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ckpt_manager._save.writer",
                    "--fd",
                    str(child_fd),
                    "--rank",
                    str(rank),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                pass_fds=(child_fd,),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(child_fd)
        self.pid: int = self._proc.pid
        """OS process id."""
        self.started_monotonic = time.monotonic()
        """When the process was started."""
        self.ready = False
        """Whether the writer has said hello (imports done)."""
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._slabs_sent: set[int] = set()
        self._responses: dict[int, dict[str, Any]] = {}
        self._closed = False

    def exit_code(self) -> int | None:
        """The exit code, or None while it runs."""
        return self._proc.poll()

    def submit(self, slab: Slab, request: dict[str, Any]) -> None:
        """Send a write request (and the staging buffer's fd the first time it is used).

        Raises:
            OSError: the writer is gone (broken pipe).
        """
        with self._send_lock:
            if slab.slab_id not in self._slabs_sent:
                self._conn.send({"op": "slab", "slab_id": slab.slab_id, "size": slab.capacity})
                reduction.send_handle(self._conn, slab.fd, self.pid)
                self._slabs_sent.add(slab.slab_id)
            self._conn.send(request)

    def send_progress(
        self,
        request_id: int,
        upto: int,
        error: str | None = None,
        checksum: int | None = None,
    ) -> None:
        """Tell the writer of a streamed write that the first `upto` bytes are final (or
        that the copy failed with `error`); the copy's last message carries the staged
        file's `checksum`, which the writer records in the rank's index.

        Raises:
            OSError: the writer is gone (broken pipe).
        """
        msg: dict[str, Any] = {"op": "staged", "request_id": request_id, "upto": upto}
        if error is not None:
            msg["error"] = error
        if checksum is not None:
            msg["checksum"] = checksum
        with self._send_lock:
            self._conn.send(msg)

    def drop_slab(self, slab_id: int) -> None:
        """Tell the writer to unmap a retired staging buffer (best effort)."""
        with self._send_lock:
            if slab_id in self._slabs_sent:
                self._slabs_sent.discard(slab_id)
                with contextlib.suppress(OSError):
                    self._conn.send({"op": "drop_slab", "slab_id": slab_id})

    def poll(self, timeout_s: float = 0.0) -> None:
        """Read every response available now (waiting up to `timeout_s` for the first)."""
        with self._recv_lock:
            wait = timeout_s
            try:
                while self._conn.poll(wait):
                    msg = self._conn.recv()
                    wait = 0.0
                    if msg.get("op") == "ready":
                        self.ready = True
                    elif msg.get("op") == "done":
                        self._responses[int(msg["request_id"])] = msg
            except (EOFError, OSError):
                # The process is gone; exit_code() tells the caller.
                return

    def take_response(self, request_id: int) -> dict[str, Any] | None:
        """The response to a request, once (None if not yet answered)."""
        return self._responses.pop(request_id, None)

    def request_stop(self) -> None:
        """Queue the sentinel: the writer exits after the requests already sent."""
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send({"op": "stop"})

    def stop(self, timeout_s: float) -> None:
        """Send the sentinel, wait up to `timeout_s`, then kill."""
        if self._closed:
            return
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send({"op": "stop"})
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_conn()

    def kill(self) -> None:
        """Kill the process now and reap it."""
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self._close_conn()

    def _close_conn(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._conn.close()
