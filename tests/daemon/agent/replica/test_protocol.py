"""The replica wire's payload path on real loopback sockets: whole payloads per system call,
byte-exact, and a stalled peer ends in a timeout ([Note: replica sockets block in the
kernel] in `daemon/agent/replica/protocol.py`)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.agent.replica import protocol
from daemon.agent.replica.protocol import COMMIT, configure, recv_payload, send_file

pytestmark = pytest.mark.timeout(60)

# Far larger than a loopback socket's buffers: a non-blocking send would need many calls.
_PAYLOAD = 24 << 20


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=10)
    server, _ = listener.accept()
    listener.close()
    configure(client, 10.0)
    configure(server, 10.0)
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def _file(path: Path, data: bytes) -> int:
    path.write_bytes(data)
    return os.open(path, os.O_RDWR)


def test_a_payload_leaves_in_one_sendfile_and_arrives_byte_exact(
    pair: tuple[socket.socket, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, server = pair
    data = os.urandom(_PAYLOAD)
    src = _file(tmp_path / "src", data)
    dst = _file(tmp_path / "dst", bytes(_PAYLOAD))
    calls: list[int] = []
    real = os.sendfile

    def counting(*args: Any) -> int:
        calls.append(args[3])
        return real(*args)

    monkeypatch.setattr(protocol.os, "sendfile", counting)
    got: list[bytes] = []
    receiver = threading.Thread(
        target=lambda: got.append(recv_payload(server, dst, _PAYLOAD, _PAYLOAD))
    )
    receiver.start()
    try:
        send_file(client, src, _PAYLOAD)
        client.sendall(COMMIT)
        receiver.join(timeout=30)
    finally:
        os.close(src)
    assert got == [COMMIT]
    # Before the fix (a Python timeout: a non-blocking descriptor) this took one call per
    # socket buffer's worth, each a GIL round trip in the daemon.
    assert calls == [_PAYLOAD]
    with os.fdopen(dst, "rb") as f:
        assert f.read() == data


def test_a_peer_that_stops_reading_or_sending_ends_in_a_timeout(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=10)
    server, _ = listener.accept()
    listener.close()
    configure(client, 0.2)
    configure(server, 0.2)
    src = _file(tmp_path / "src", os.urandom(_PAYLOAD))
    dst = _file(tmp_path / "dst", bytes(_PAYLOAD))
    try:
        # Nobody reads on `server`: the send stops once the buffers are full.
        with pytest.raises(TimeoutError):
            send_file(client, src, _PAYLOAD)
        # Nobody sends on `client` any more: the receive stops after what is buffered.
        with pytest.raises(TimeoutError):
            recv_payload(server, dst, _PAYLOAD, _PAYLOAD)
    finally:
        os.close(src)
        os.close(dst)
        client.close()
        server.close()
