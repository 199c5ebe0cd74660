"""The ranks' output, printed by the daemon: how rank logs reach the terminal above the live line.

The ranks are processes of their own (started by torch elastic's agent); a line they wrote
straight to the terminal would cut through the daemon's status line (see [Note: one writer to
the terminal] in `progress.py`). So on a terminal the agent redirects every rank's stdout and
stderr (at the file-descriptor level: Python, C++ and the rank's checkpoint writers alike) to
files of the run directory, `RelayLogsSpecs` tells `RankOutputRelay` which files each attempt
writes, and the relay's thread prints every complete line through the daemon's console.

Off a terminal nothing is redirected: the ranks keep writing JSON lines to the daemon's stderr.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import structlog
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest

__all__ = ["RankOutputRelay", "RelayLogsSpecs"]

log = structlog.get_logger("trainingd.relay")

_POLL_S = 0.1
_READ_BYTES = 1 << 16


class _Followed:
    """One output file of one rank: its handle once it exists, and a partial last line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: BinaryIO | None = None
        self.partial = b""

    def read_lines(self) -> list[bytes]:
        """Complete lines written since the last call (none while the file does not exist)."""
        if self.handle is None:
            try:
                self.handle = self.path.open("rb")
            except FileNotFoundError:
                return []
        data = self.partial + self._read_available(self.handle)
        *lines, self.partial = data.split(b"\n")
        return lines

    @staticmethod
    def _read_available(handle: BinaryIO) -> bytes:
        chunks = []
        while chunk := handle.read(_READ_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> bytes:
        """Close the file; returns an unterminated last line, if any."""
        rest, self.partial = self.partial, b""
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        return rest


class RankOutputRelay:
    """Follows the ranks' output files and hands every line to `emit`, in order per file.

    One thread owns the files; `close()` stops it and prints what is left (every wait has a
    timeout). A failing `emit` does not stop the relay: the line is lost (counted in
    `num_lost_lines`, logged by `close()`), the next is tried.

    Args:
        emit: called with each line (no newline), from the relay's thread.
        poll_s: how often the files are read.
    """

    def __init__(self, emit: Callable[[str], None], *, poll_s: float = _POLL_S) -> None:
        self._emit = emit
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._files: list[_Followed] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainingd-relay", daemon=True)
        self.num_lost_lines = 0
        """Lines `emit` failed to print."""
        self._reported_lost = 0

    def start(self) -> RankOutputRelay:
        """Start following; returns self."""
        self._thread.start()
        return self

    def follow(self, paths: list[str]) -> None:
        """Also follow these files (a new attempt's; they need not exist yet)."""
        with self._lock:
            self._files.extend(_Followed(Path(p)) for p in paths)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, then print what the files still hold (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self._pump()
        with self._lock:
            files, self._files = self._files, []
        for f in files:
            rest = f.close()
            if rest:
                self._print(rest)
        if self.num_lost_lines > self._reported_lost:
            self._reported_lost = self.num_lost_lines
            log.warning("rank_output_lines_lost", num_lines=self.num_lost_lines)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._pump()

    def _pump(self) -> None:
        with self._lock:
            files = list(self._files)
        for f in files:
            try:
                lines = f.read_lines()
            except OSError as err:
                lines = [f"[trainingd] cannot read {f.path}: {err}".encode()]
            for line in lines:
                self._print(line)

    def _print(self, line: bytes) -> None:
        try:
            self._emit(line.decode(errors="replace").rstrip("\r"))
        except Exception:  # a terminal hiccup must not end the relay, nor the run
            self.num_lost_lines += 1


class RelayLogsSpecs(DefaultLogsSpecs):
    """torch elastic's default log files, with every rank's stdout/stderr redirected there and
    each attempt's files handed to `relay` as the agent creates them.

    Args:
        log_dir: where the agent writes the attempt folders (`<run dir>/elastic`).
        relay: the daemon's relay.
    """

    def __init__(self, log_dir: str, relay: RankOutputRelay) -> None:
        super().__init__(log_dir=log_dir, redirects=Std.ALL, tee=Std.NONE)
        self._relay = relay

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Create the attempt's files (as the default does) and start relaying them."""
        dest = super().reify(envs)
        paths = [dest.stdouts[r] for r in sorted(dest.stdouts)]
        paths += [dest.stderrs[r] for r in sorted(dest.stderrs)]
        self._relay.follow([p for p in paths if p])
        return dest
