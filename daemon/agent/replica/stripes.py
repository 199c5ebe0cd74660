"""Replica payloads striped over parallel TCP connections to the same peer.

[Note: replica payloads go over parallel streams] One TCP stream is carried by one core at
each end: on loopback the receiver's core copies every byte out of the sender's pages alone
(`sendfile` leaves no copy to the sender), and between hosts one stream's per-core
processing caps it well below a fast NIC. `[checkpoint] memory_replica_streams` connections
share each large payload, as NCCL's socket transport and GridFTP share theirs: a 256 MiB
snapshot on this 2-core VM went at 0.75 of a plain loopback copy of the same bytes on one
connection, 1.06 on two, 1.25 on four (`bench/replica_streams.py`).

The put's own connection carries stripe 0 and the frames; each other stripe goes on an extra
connection of the same sender (a "part": frame `{"op": "part", "session", "seq", "index"}`
then the stripe's raw bytes). The put frame proposes `stripes` with the sender's `session`
(random, one per set of connections) and `seq` (one per put); the receiver's go-ahead says how
many it takes (absent: 1, as a receiver without stripes answers), and both sides cut the
payload with `stripe_ranges`. The receiver registers the stripes' destinations before its
go-ahead, so a part never arrives before its place exists; a part for no open put, or a
stripe that fails, closes the stripes' connections and fails the put (the sender reconnects
and the next tick sends the newest snapshot again).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from daemon.agent.replica.protocol import ProtocolError, recv_into, send_file, send_frame

__all__ = [
    "MAX_STRIPES",
    "STRIPE_MIN_BYTES",
    "StripeBoard",
    "StripeSender",
    "StripedFill",
    "stripe_count",
    "stripe_ranges",
]

MAX_STRIPES = 16
"""Most stripes a receiver takes for one payload (`memory_replica_streams` is at most this)."""
STRIPE_MIN_BYTES = 4 << 20
"""Smallest stripe worth its own connection: smaller payloads go on fewer streams."""
_ALIGN = 1 << 20


def stripe_count(nbytes: int, streams: int) -> int:
    """Stripes a sender with `streams` connections proposes for a payload of `nbytes`."""
    return max(1, min(streams, MAX_STRIPES, nbytes // STRIPE_MIN_BYTES))


def stripe_ranges(nbytes: int, stripes: int) -> list[tuple[int, int]]:
    """`(offset, length)` of each stripe of `nbytes`, stripe 0 first; at most `stripes`
    (fewer when MiB-aligned stripes cover the payload sooner)."""
    if stripes <= 1 or nbytes <= _ALIGN:
        return [(0, nbytes)]
    size = -(-nbytes // stripes)
    size = -(-size // _ALIGN) * _ALIGN
    return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)]


# ------------------------------------------------------------------ receiving side
class _Pending:
    """The stripes of one put that arrive on other connections than the put's own."""

    def __init__(self, views: dict[int, memoryview]) -> None:
        self.views = views
        self.claimed: dict[int, socket.socket] = {}
        self.finished: dict[int, str | None] = {}  # index -> None (done) or why it failed
        self.cond = threading.Condition()


class StripeBoard:
    """The receiver's open puts, by `(session, seq)`: where each arriving part goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], _Pending] = {}

    def open(self, session: str, seq: int, views: dict[int, memoryview]) -> _Pending:
        """Register the destinations of stripes 1.. of a put (before its go-ahead)."""
        pending = _Pending(views)
        with self._lock:
            self._open[(session, seq)] = pending
        return pending

    def receive_part(self, conn: socket.socket, session: str, seq: int, index: int) -> None:
        """Receive one part (its frame already read) into its place.

        Raises:
            ProtocolError: no open put has that part, or it came twice.
            OSError: the connection broke or timed out (the put is failed too).
        """
        with self._lock:
            pending = self._open.get((session, seq))
        if pending is None:
            raise ProtocolError(f"part {index} of put {seq} belongs to no open put")
        with pending.cond:
            view = pending.views.get(index)
            if view is None or index in pending.claimed:
                raise ProtocolError(f"part {index} of put {seq} is not expected")
            pending.claimed[index] = conn
        failure: str | None = None
        try:
            recv_into(conn, view)
        except BaseException as err:
            failure = f"part {index}: {type(err).__name__}: {err}"
            raise
        finally:
            with pending.cond:
                pending.finished[index] = failure
                pending.cond.notify_all()

    def close(self, session: str, seq: int, pending: _Pending, timeout_s: float) -> None:
        """Forget a put; parts still arriving have their connections shut down and are
        waited for, so no thread writes into the put's destination once this returns."""
        with self._lock:
            self._open.pop((session, seq), None)
        with pending.cond:
            running = [c for i, c in pending.claimed.items() if i not in pending.finished]
        for conn in running:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with pending.cond:
            pending.cond.wait_for(
                lambda: all(i in pending.finished for i in pending.claimed), timeout_s
            )
        for view in pending.views.values():
            view.release()


class StripedFill:
    """Fills a put's payload from its own connection and its parts (`recv_payload`'s
    `fill`): registers the parts, sends the go-ahead, receives stripe 0, waits for the rest.

    Args:
        board: the receiver's open puts.
        session, seq: the put's identity (from its frame).
        stripes: stripes the receiver took (said in the go-ahead).
        timeout_s: longest wait for the other stripes once stripe 0 is in.
    """

    def __init__(
        self, board: StripeBoard, session: str, seq: int, stripes: int, timeout_s: float
    ) -> None:
        self._board, self._session, self._seq = board, session, seq
        self._stripes, self._timeout_s = stripes, timeout_s

    def fill(
        self, sock: socket.socket, payload: memoryview, ready: Callable[[], None] | None
    ) -> None:
        """Receive every stripe of `payload`.

        Raises:
            ProtocolError: a stripe failed, or did not arrive within the timeout.
            OSError: the put's own connection broke or timed out.
        """
        ranges = stripe_ranges(len(payload), self._stripes)
        views = {i: payload[a : a + n] for i, (a, n) in enumerate(ranges) if i}
        pending = self._board.open(self._session, self._seq, views)
        try:
            if ready is not None:
                ready()
            start, length = ranges[0]
            with payload[start : start + length] as first:
                recv_into(sock, first)
            with pending.cond:
                if not pending.cond.wait_for(
                    lambda: len(pending.finished) == len(views), self._timeout_s
                ):
                    raise ProtocolError(
                        f"{len(views) - len(pending.finished)} of {len(ranges)} stripes "
                        f"did not arrive within {self._timeout_s:g} s"
                    )
                failures = [f for f in pending.finished.values() if f is not None]
            if failures:
                raise ProtocolError("a stripe failed: " + "; ".join(failures))
        finally:
            self._board.close(self._session, self._seq, pending, timeout_s=5.0)


# ------------------------------------------------------------------ sending side
class StripeSender:
    """A sender's extra connections to one peer, each with its own sending thread.

    Args:
        connect: opens one configured connection to the peer.
        extra: connections besides the put's own (`memory_replica_streams` - 1).
    """

    def __init__(self, connect: Callable[[], socket.socket], extra: int) -> None:
        self.session = secrets.token_hex(8)
        self._seq = 0
        self._socks: list[socket.socket] = []
        try:
            for _ in range(extra):
                self._socks.append(connect())
        except BaseException:
            self.close()
            raise
        self._pool = (
            ThreadPoolExecutor(max_workers=extra, thread_name_prefix="trainingd-replica-stripe")
            if extra
            else None
        )

    @property
    def streams(self) -> int:
        """Connections a put may use: the put's own plus the extra ones."""
        return 1 + len(self._socks)

    def next_seq(self) -> int:
        """A fresh put number for this session."""
        self._seq += 1
        return self._seq

    def start(self, fd: int, ranges: list[tuple[int, int]], seq: int) -> list[Future[None]]:
        """Start sending stripes 1.. of `fd` (stripe 0 is the caller's, on the put's own
        connection); `finish` waits for them."""
        if len(ranges) - 1 > len(self._socks) or (len(ranges) > 1 and self._pool is None):
            raise ProtocolError(f"{len(ranges)} stripes for {self.streams} connections")
        futures = []
        for index in range(1, len(ranges)):
            sock = self._socks[index - 1]
            offset, length = ranges[index]
            assert self._pool is not None
            futures.append(self._pool.submit(self._send_part, sock, fd, seq, index, offset, length))
        return futures

    def _send_part(
        self, sock: socket.socket, fd: int, seq: int, index: int, offset: int, length: int
    ) -> None:
        send_frame(sock, {"op": "part", "session": self.session, "seq": seq, "index": index})
        send_file(sock, fd, length, offset=offset)

    def finish(self, futures: list[Future[None]], *, abort: bool) -> None:
        """Wait for the stripes `start` began (shutting their connections down first when
        `abort`: the put failed, they must not block); raises the first stripe's error."""
        if abort:
            self._shutdown()
        first: BaseException | None = None
        for future in futures:
            err = future.exception()
            if err is not None and first is None:
                first = err
        if first is not None:
            if not abort:
                self._shutdown()
            raise first

    def _shutdown(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close every extra connection and stop the threads."""
        self._shutdown()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
