"""Human output of `ckptctl`: sizes, times, ages, aligned tables and a TTY progress bar."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["Progress", "format_age", "format_bytes", "format_local_time", "iso_local", "table"]


def format_bytes(num_bytes: int) -> str:
    """`1536` -> `1.5 KiB` (binary units; plain bytes below 1 KiB)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def iso_local(unix_s: float) -> str:
    """ISO 8601 in the local time zone with its offset: `2026-11-30T04:12:07+01:00`."""
    return datetime.datetime.fromtimestamp(unix_s).astimezone().isoformat(timespec="seconds")


def format_local_time(unix_s: float) -> str:
    """`2026-11-30 04:12:07 CET` (local time zone)."""
    return datetime.datetime.fromtimestamp(unix_s).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def format_age(seconds: float) -> str:
    """`42s`, `5m`, `3h12m`, `4d2h` (negative clock skew reads as `0s`)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: set[int]) -> str:
    """Columns aligned on the widest cell; column indices in `right` are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


class Progress:
    """Bytes and files done, redrawn on one line of a TTY (silent when not a TTY).

    Thread-safe: `advance` may be called from reader threads.
    """

    def __init__(self, total_bytes: int, total_files: int, *, stream: TextIO | None = None) -> None:
        """Start counting.

        Args:
            total_bytes: bytes to move.
            total_files: files to produce.
            stream: where to draw (default stderr); nothing is drawn unless it is a TTY.
        """
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        """Whether the bar is drawn."""
        self.total_bytes = max(0, total_bytes)
        """Bytes to move."""
        self.total_files = total_files
        """Files to produce."""
        self.done_bytes = 0
        """Bytes moved so far."""
        self.done_files = 0
        """Files finished so far."""
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def advance(self, num_bytes: int = 0, num_files: int = 0) -> None:
        """Count progress; redraws at most 10 times a second."""
        with self._lock:
            self.done_bytes += num_bytes
            self.done_files += num_files
            now = time.monotonic()
            if self.enabled and (now - self._last_draw >= 0.1 or num_files):
                self._last_draw = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        frac = min(1.0, frac)
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = self.done_bytes / max(1e-6, now - self._started)
        self._stream.write(
            f"\r[{bar}] {frac * 100:5.1f}%  {format_bytes(self.done_bytes)} / "
            f"{format_bytes(self.total_bytes)}  files {self.done_files}/{self.total_files}  "
            f"{format_bytes(int(rate))}/s "
        )
        self._stream.flush()

    def close(self) -> None:
        """Finish the line."""
        if self.enabled:
            with self._lock:
                self._draw(time.monotonic())
                self._stream.write("\n")
                self._stream.flush()
