"""systemd's notify protocol without a dependency: one datagram per message.

`Notifier` sends newline-separated `KEY=VALUE` lines to the `AF_UNIX` datagram socket named by
`$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without the variable every
call is a no-op; send errors are ignored (systemd may be gone during shutdown). The watchdog
interval comes from `$WATCHDOG_USEC`, honoured only when `$WATCHDOG_PID` is unset or names this
process. Only the daemon's main process notifies (`NotifyAccess=main`).

`TimeoutExtender` decides when to send `EXTEND_TIMEOUT_USEC=`: only after the node moved (see
[Note: extend systemd's timeouts only while the node makes progress]).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Hashable, Mapping

__all__ = ["Notifier", "TimeoutExtender"]


class Notifier:
    """Sends sd_notify messages for this process.

    Args:
        env: environment to read `NOTIFY_SOCKET`, `WATCHDOG_USEC`, `WATCHDOG_PID` from.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval_s: float | None = (
            int(usec) / 1e6 / 2 if usec.isdigit() and int(usec) > 0 and mine else None
        )
        """How often to send `WATCHDOG=1` (half of systemd's period), None when off."""
        self._last_watchdog = float("-inf")
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        """Whether `$NOTIFY_SOCKET` is set."""
        return self._sock is not None

    def send(self, **fields: str | int) -> bool:
        """Send one message (`send(READY=1, STATUS="training")`); returns whether it went out."""
        if self._sock is None or not fields:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(payload, self._address)
        except OSError:
            return False
        return True

    def watchdog(self, now: float | None = None) -> bool:
        """Send `WATCHDOG=1` if the watchdog is on and half its period has passed."""
        if self.watchdog_interval_s is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_watchdog < self.watchdog_interval_s:
            return False
        self._last_watchdog = now
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        """Close the socket (further sends are no-ops)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class TimeoutExtender:
    """Sends `EXTEND_TIMEOUT_USEC=` only when the node moved since the previous extension.

    [Note: extend systemd's timeouts only while the node makes progress]
    systemd counts `TimeoutStartSec=` (start-up) and `TimeoutStopSec=` (draining) from the state
    change; each `EXTEND_TIMEOUT_USEC=<window>` lets the service run `window` past *now*, and the
    timeout fires once the original timeout has passed and no extension arrived within the last
    window. Re-sending it on a timer would keep a hung restore "activating" forever, so the
    supervisor passes a progress mark every tick (node phase, world size, restarts, each rank's
    phase, step and heartbeat: ranks beat on each phase change, every step and every read of a
    restore) and an extension goes out, at most every `every_s`, only when the mark changed since
    the last one. A node that stops moving gets its last extension at most `every_s` after its
    last move, so systemd's timeout fires `window_s` to `window_s + every_s` after it. Waiting
    for peers at rendezvous moves nothing locally: `TimeoutStartSec=` itself must cover the
    rendezvous timeout and the model build (deploy/systemd/trainingd.service).

    Args:
        notifier: where the extensions go.
        window_s: time each extension grants from now (its `EXTEND_TIMEOUT_USEC` value); longer
            than the slowest single step of progress (one 64 MiB restore read, one training
            step).
        every_s: shortest interval between two extensions.

    Raises:
        ValueError: `window_s` is not longer than `every_s`, or either is not positive.
    """

    def __init__(self, notifier: Notifier, *, window_s: float, every_s: float) -> None:
        if every_s <= 0 or window_s <= every_s:
            raise ValueError(
                f"window_s={window_s}, every_s={every_s}: use 0 < every_s < window_s, or the "
                "timeout fires between two extensions of a node that keeps moving"
            )
        self._notifier = notifier
        self._window_usec = int(window_s * 1_000_000)
        self._every_s = every_s
        self._mark: Hashable = object()  # equal to no mark: the first observation is a move
        self._moved = False
        self._last_sent = float("-inf")

    def observe(self, mark: Hashable, now: float) -> bool:
        """Record the node's progress mark; extend if it changed and `every_s` has passed.

        Args:
            mark: anything that changes when the node makes progress (compared with `==`).
            now: monotonic time.

        Returns:
            Whether an extension went out.
        """
        if mark != self._mark:
            self._mark = mark
            self._moved = True
        if not self._moved or now - self._last_sent < self._every_s:
            return False
        self._moved = False
        self._last_sent = now
        return self._notifier.send(EXTEND_TIMEOUT_USEC=self._window_usec)
