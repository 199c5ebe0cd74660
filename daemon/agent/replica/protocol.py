"""The replica wire protocol: JSON frames, raw payloads, a commit byte.

One TCP connection carries any number of requests, one at a time:

    frame    = u32 big-endian length + that many bytes of UTF-8 JSON (an object)
    put      sender -> frame {"op": "put", "run_id", "round", "node", "meta_bytes"
                              [, "stripes", "session", "seq"]} + that many bytes: the meta
                              file as the rank wrote it ([Note: a replica costs one parse
                              at each end] in `sender.py`)
             receiver -> frame {"ok": true [, "stripes"]} (send it) or {"ok": false, "reason",
                              "detail"}
             sender -> meta["payload_bytes"] raw bytes (stripe 0 only, when striped)
             receiver -> frame {"received": payload_bytes}, once every byte is in its slot
             sender -> one trailer byte
             receiver -> frame {"ok": true} (held, meta written) or a refusal
    part     sender -> frame {"op": "part", "session", "seq", "index"} + that stripe's raw
                              bytes, on another connection of the same sender, no reply
                              ([Note: replica payloads go over parallel streams], `stripes.py`)
    list     fetcher -> frame {"op": "list", "run_id", "ranks": [int]}
             holder -> frame {"ok": true, "replicas": [{"rank", "slot", "step", ...}],
                              "local_layouts": [hex]}
    get      fetcher -> frame {"op": "get", "run_id", "rank", "slot", "step"}
             holder -> frame {"ok": true, "meta"} + payload bytes, or a refusal
             fetcher -> frame {"received": payload_bytes}
             holder -> one trailer byte

The trailer is `COMMIT` when the bytes the reader holds are the bytes the meta describes (its
slot's meta was unchanged from before the first byte was sent until the reader said it had
them all), `ABORT` when the slot was emptied meanwhile (a newer snapshot is being written into
it: the bytes may be torn). A reader still verifies the payload's checksum before it writes a
meta; the trailer only tells a superseded copy (not a failure) from a corrupt one.

[Note: a sent page is read when the peer reads it] `os.sendfile` from a tmpfs file into a TCP
socket copies nothing: the socket's buffers hold references to the file's pages, and the bytes
are read from those pages only when the peer's `recv` copies them out (and again on a TCP
retransmission). A page the rank overwrites after `sendfile` returned is sent as it is then
(measured on this kernel, 6.18: 1 MiB sent over loopback, then overwritten before the peer's
`recv`: the peer got the new bytes, all of them). The sender used to decide its trailer as
soon as `sendfile` returned, so a slot reused while its bytes still sat in the buffers went
out torn under a `COMMIT`: the receiver's checksum refused it, and the replica of that step was
lost (seen as a `checksum` refusal when a replica lagged two steps on the 2-core VM). The
sender now waits for the reader's receipt (`await_receipt`; `recv_payload` sends it) before it
looks at the meta: from then on the reader holds its own copy.

Payloads leave with `os.sendfile` from the slot file (no copy through user space) and arrive
with `recv_into` straight into the mapped destination file; a large put is striped over the
sender's `memory_replica_streams` connections.

[Note: replica sockets block in the kernel] Every replica socket is a blocking socket whose
timeouts are the kernel's (`SO_RCVTIMEO`, `SO_SNDTIMEO`; `configure`), not Python's: a Python
timeout makes the descriptor non-blocking, so each `sendfile` or `recv_into` returns after one
socket buffer's worth (a few hundred KiB on loopback) and every chunk costs a poll and a GIL
round trip, in a daemon whose other threads hold the GIL meanwhile (measured: 0.1 of a plain
loopback copy). Blocking, one `sendfile` sends a whole payload and one `recv_into` with
`MSG_WAITALL` fills it: the GIL is taken back once per payload. A peer that stalls still ends
the call after the timeout (`EAGAIN`, raised as `TimeoutError`).
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "ABORT",
    "COMMIT",
    "MAX_FRAME_BYTES",
    "PayloadFill",
    "ProtocolError",
    "Refusal",
    "await_receipt",
    "configure",
    "recv_exact",
    "recv_frame",
    "recv_into",
    "recv_meta",
    "recv_payload",
    "send_file",
    "send_frame",
    "send_meta",
]

COMMIT = b"C"
"""Trailer: the payload is the one its meta describes."""
ABORT = b"A"
"""Trailer: the source slot changed during the send; discard the payload."""
MAX_FRAME_BYTES = 64 << 20
"""Largest JSON frame accepted (a meta with every tensor's record; far above any real one)."""

_LENGTH = struct.Struct(">I")


class Refusal(enum.StrEnum):
    """Why a replica was refused or failed: the `reason` label of the failures counter."""

    FOREIGN_RUN = "foreign_run"
    """It belongs to another run id."""
    STALE_ROUND = "stale_round"
    """Its membership round is older than the newest accepted from that sender."""
    MISMATCH = "mismatch"
    """Its rank, world size or layout does not match what the fetcher expects."""
    CHECKSUM = "checksum"
    """Its payload does not match its checksum (or its meta its own checksum)."""
    NO_SPACE = "no_space"
    """The receiving tmpfs has no room for it (posix_fallocate failed)."""
    PROTOCOL = "protocol"
    """A malformed frame, an unknown op, a missing slot."""
    CONNECTION = "connection"
    """The peer could not be reached, or the connection broke mid-transfer."""


class ProtocolError(ConnectionError):
    """The peer broke the protocol or closed the connection mid-message."""


def configure(sock: socket.socket, timeout_s: float) -> None:
    """Make `sock` blocking with kernel timeouts of `timeout_s` per call ([Note: replica
    sockets block in the kernel]) and without Nagle's delay (frames are small)."""
    sock.settimeout(None)
    seconds = int(timeout_s)
    timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _frame(obj: dict[str, Any]) -> bytes:
    """One JSON frame's bytes: length, then the object."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send one JSON frame."""
    sock.sendall(_frame(obj))


def send_meta(sock: socket.socket, request: dict[str, Any], meta: bytes) -> None:
    """Send a request frame followed by a meta file's bytes (`request["meta_bytes"]` says how
    many)."""
    sock.sendall(_frame({**request, "meta_bytes": len(meta)}) + meta)


def recv_meta(sock: socket.socket, request: dict[str, Any]) -> bytes:
    """The meta bytes that follow `request` (sent by `send_meta`).

    Raises:
        ProtocolError: no valid `meta_bytes` in `request`, too many of them, or a connection
            closed before they all came.
    """
    nbytes = request.get("meta_bytes")
    if type(nbytes) is not int or not 0 < nbytes <= MAX_FRAME_BYTES:
        raise ProtocolError(
            f"a {request.get('op')!r} request with meta_bytes {nbytes!r} (1 to {MAX_FRAME_BYTES}; "
            "a peer of another trainingd version sends its meta otherwise)"
        )
    return recv_exact(sock, nbytes)


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Exactly `nbytes` bytes.

    Raises:
        ProtocolError: the connection closed first.
    """
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`.

    Raises:
        ProtocolError: the connection closed before `view` was full.
    """
    done, total = 0, len(view)
    while done < total:
        # Each slice is released at once, even when the receive fails: a slice a traceback
        # keeps alive would pin a mapped slot (`recv_payload` could not unmap it).
        # MSG_WAITALL: one call fills the rest ([Note: replica sockets block in the kernel]);
        # it returns short only at a timeout, a signal or the peer's close.
        with view[done:] as rest:
            try:
                got = sock.recv_into(rest, total - done, socket.MSG_WAITALL)
            except BlockingIOError as err:  # SO_RCVTIMEO expired
                raise TimeoutError(f"no byte for the socket's timeout after {done}") from err
        if got == 0:
            raise ProtocolError(f"connection closed after {done} of {total} bytes")
        done += got


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next JSON frame, or None when the peer closed the connection between frames.

    Raises:
        ProtocolError: a frame that is too large, not JSON, or not an object, or a connection
            closed mid-frame.
    """
    head = bytearray(_LENGTH.size)
    got = sock.recv_into(head, _LENGTH.size)
    if got == 0:
        return None
    if got < _LENGTH.size:
        recv_into(sock, memoryview(head)[got:])
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    try:
        obj = json.loads(recv_exact(sock, length))
    except ValueError as err:
        raise ProtocolError(f"frame is not JSON: {err}") from err
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


def send_file(sock: socket.socket, fd: int, nbytes: int, offset: int = 0) -> None:
    """Send `nbytes` of `fd` from `offset` with `os.sendfile` (a socket made by `configure`:
    one call sends it all, [Note: replica sockets block in the kernel]).

    Raises:
        ProtocolError: the file is shorter than `nbytes`.
        OSError: the connection broke or timed out (`TimeoutError`).
    """
    sent = 0
    while sent < nbytes:
        try:
            n = os.sendfile(sock.fileno(), fd, offset + sent, nbytes - sent)
        except BlockingIOError as err:  # SO_SNDTIMEO expired: the peer stopped reading
            raise TimeoutError(f"the peer took no byte for the timeout after {sent}") from err
        if n == 0:
            raise ProtocolError(f"file ended after {sent} of {nbytes} bytes")
        sent += n


def await_receipt(sock: socket.socket, nbytes: int) -> None:
    """Wait for the reader's receipt of all `nbytes` of a payload (`recv_payload` sends it):
    only then may the sender judge its trailer ([Note: a sent page is read when the peer reads
    it]).

    Raises:
        ProtocolError: no receipt (the connection closed, or another frame came).
        OSError: the connection broke or timed out.
    """
    reply = recv_frame(sock)
    if reply is None:
        raise ProtocolError("the reader closed the connection before its receipt")
    if reply.get("received") != nbytes:
        raise ProtocolError(f"expected the receipt of {nbytes} bytes, got {reply!r}")


class PayloadFill(Protocol):
    """Receives a payload some other way than all on the request's connection (the
    stripes of `stripes.py`)."""

    def fill(
        self, sock: socket.socket, payload: memoryview, ready: Callable[[], None] | None
    ) -> None:
        """Call `ready` (if any), then fill all of `payload`; no thread may still write into
        it when this returns or raises."""


def recv_payload(
    sock: socket.socket,
    fd: int,
    capacity: int,
    nbytes: int,
    ready: Callable[[], None] | None = None,
    fill: PayloadFill | None = None,
) -> bytes:
    """Receive `nbytes` of payload straight into the file behind `fd` (allocated to
    `capacity`, mapped shared), send the receipt (`await_receipt`), then receive the trailer
    byte; returns the trailer.

    Args:
        ready: called once the destination is mapped, before the first byte is read (a
            receiver sends its go-ahead there: the sender's bytes then never wait for the
            mapping's page faults).
        fill: receives the payload instead of one `recv_into` on `sock` (striped puts).

    Raises:
        ProtocolError: the connection closed early.
        OSError: the connection broke or timed out.
    """
    if not nbytes:
        if ready is not None:
            ready()
        send_frame(sock, {"received": 0})
        return recv_exact(sock, 1)
    # Pre-faulted: one page fault per 4 KiB page would otherwise slow the receive down.
    mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    try:
        with memoryview(mm) as view, view[:nbytes] as payload:
            if fill is not None:
                fill.fill(sock, payload, ready)
            else:
                if ready is not None:
                    ready()
                recv_into(sock, payload)
    finally:
        mm.close()  # every view of it is released by now, even after a broken receive
    send_frame(sock, {"received": nbytes})
    return recv_exact(sock, 1)
