"""systemd's notify protocol without a dependency: one datagram per message.

`Notifier` sends newline-separated `KEY=VALUE` lines to the `AF_UNIX` datagram socket named by
`$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without the variable every
call is a no-op; send errors are ignored (systemd may be gone during shutdown). The watchdog
interval comes from `$WATCHDOG_USEC`, honoured only when `$WATCHDOG_PID` is unset or names this
process. Only the daemon's main process notifies (`NotifyAccess=main`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier"]


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
