"""sd_notify without systemd: a datagram socket in the test plays systemd."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon._notify import Notifier


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
