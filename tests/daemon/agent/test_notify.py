"""sd_notify without systemd: a datagram socket in the test plays systemd."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.agent.notify import Notifier, TimeoutExtender


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()


def test_messages_arrive_in_order_and_watchdog_is_rate_limited(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n.enabled
    assert n.watchdog_interval_s == 1.0
    assert n.send(READY=1, STATUS="training")
    assert n.watchdog(now=10.0)
    assert not n.watchdog(now=10.5)  # half the period has not passed
    assert n.watchdog(now=11.0)
    assert n.send(STOPPING=1)
    got = [sock.recv(4096).decode() for _ in range(4)]
    assert got == ["READY=1\nSTATUS=training", "WATCHDOG=1", "WATCHDOG=1", "STOPPING=1"]
    n.close()
    assert not n.send(READY=1)


def test_abstract_socket_and_disabled_cases() -> None:
    name = f"trainingd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).send(READY=1)
        assert sock.recv(100) == b"READY=1"
    finally:
        sock.close()
    off = Notifier({})
    assert not off.enabled
    assert not off.send(READY=1)
    assert not off.watchdog()
    # The watchdog belongs to another process: do not ping it.
    other = Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "10", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None
    # A vanished systemd is not an error.
    assert not Notifier({"NOTIFY_SOCKET": "/nonexistent/sock"}).send(READY=1)


def _drain(sock: socket.socket) -> list[str]:
    sock.settimeout(0.2)
    out: list[str] = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            return out


def test_extensions_go_out_only_after_progress(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    ext = TimeoutExtender(Notifier({"NOTIFY_SOCKET": path}), window_s=20.0, every_s=5.0)
    assert ext.observe("rendezvous", now=0.0)  # the first mark is a move
    assert not ext.observe("loading", now=1.0)  # moved, but 5 s have not passed
    assert ext.observe("loading", now=5.0)  # the move at 1.0 is extended now
    # Stuck: the mark stays the same, so no extension however long systemd waits.
    assert [ext.observe("loading", now=t) for t in (10.0, 15.0, 20.0, 60.0)] == [False] * 4
    # Moving again (a restore read beat): extended at once, every 5 s while it moves.
    assert ext.observe(("loading", 1), now=61.0)
    assert not ext.observe(("loading", 2), now=62.0)
    assert ext.observe(("loading", 2), now=66.0)
    assert _drain(sock) == ["EXTEND_TIMEOUT_USEC=20000000"] * 4


def test_extender_rejects_a_window_shorter_than_its_interval() -> None:
    with pytest.raises(ValueError, match="0 < every_s < window_s"):
        TimeoutExtender(Notifier({}), window_s=5.0, every_s=5.0)
