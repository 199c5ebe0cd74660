"""The replica wire protocol: JSON frames, raw payloads, a commit byte.

One TCP connection carries any number of requests, one at a time:

    frame    = u32 big-endian length + that many bytes of UTF-8 JSON (an object)
    put      sender -> frame {"op": "put", "run_id", "round", "node", "meta"}
             receiver -> frame {"ok": true} (send it) or {"ok": false, "reason", "detail"}
             sender -> meta["payload_bytes"] raw bytes + one trailer byte
             receiver -> frame {"ok": true} (held, meta written) or a refusal
    list     fetcher -> frame {"op": "list", "run_id", "ranks": [int]}
             holder -> frame {"ok": true, "replicas": [{"rank", "slot", "step", ...}],
                              "local_layouts": [hex]}
    get      fetcher -> frame {"op": "get", "run_id", "rank", "slot", "step"}
             holder -> frame {"ok": true, "meta"} + payload bytes + trailer, or a refusal

The trailer is `COMMIT` when the bytes sent are the bytes the meta describes (its slot's
meta was unchanged from before the first byte to after the last), `ABORT` when the slot was
emptied meanwhile (a newer snapshot is being written into it: the bytes may be torn). A reader
still verifies the payload's checksum before it writes a meta; the trailer only tells a
superseded copy (not a failure) from a corrupt one.

Payloads leave with `os.sendfile` from the slot file (no copy through user space) and arrive
with `recv_into` straight into the mapped destination file.
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import socket
import struct
from typing import Any

__all__ = [
    "ABORT",
    "COMMIT",
    "MAX_FRAME_BYTES",
    "ProtocolError",
    "Refusal",
    "recv_exact",
    "recv_frame",
    "recv_into",
    "recv_payload",
    "send_file",
    "send_frame",
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


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send one JSON frame."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


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
        with view[done:] as rest:
            got = sock.recv_into(rest, min(total - done, 1 << 24))
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


def send_file(sock: socket.socket, fd: int, nbytes: int) -> None:
    """Send `nbytes` of `fd` from offset 0 (`socket.sendfile`: `os.sendfile` on Linux, which
    also honours the socket's timeout).

    Raises:
        ProtocolError: the file is shorter than `nbytes`.
        OSError: the connection broke or timed out.
    """
    with os.fdopen(fd, "rb", closefd=False) as f:
        sent = sock.sendfile(f, 0, nbytes)
    if sent != nbytes:
        raise ProtocolError(f"file ended after {sent} of {nbytes} bytes")


def recv_payload(sock: socket.socket, fd: int, capacity: int, nbytes: int) -> bytes:
    """Receive `nbytes` of payload straight into the file behind `fd` (allocated to
    `capacity`, mapped shared), then the trailer byte; returns the trailer.

    Raises:
        ProtocolError: the connection closed early.
        OSError: the connection broke or timed out.
    """
    if nbytes:
        # Pre-faulted: one page fault per 4 KiB page would otherwise slow the receive down.
        mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        try:
            with memoryview(mm) as view, view[:nbytes] as payload:
                recv_into(sock, payload)
        finally:
            mm.close()  # every view of it is released by now, even after a broken receive
    return recv_exact(sock, 1)
