"""Stop and checkpoint requests, from the daemon (or a signal) to the ranks' training loops.

The daemon cannot call into its ranks, and a signal it forwards could reach a rank that is not
yet listening. So requests are *files* in `<run_dir>/control/`, level-triggered and cheap to poll
(two `stat` calls per step): `stop` exists once a stop was requested and holds the name of the
signal that asked for it (empty for a membership change); `checkpoint` holds a counter the daemon
increments on every SIGUSR1. A rank also turns its own SIGTERM/SIGINT/SIGUSR1 into the
same requests when no daemon supervises it (plain `torchrun` forwards signals to workers).

Ranks act on a request only after agreeing on it: the loop sums the local flags across all ranks
with the step's loss all-reduce ([Note: one all-reduce per step agrees on stop and checkpoint]
in `daemon/rank/loop.py`), so every rank stops, and saves, at the same step even when nodes see the
request at different times.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType

__all__ = ["RankControl", "clear_stop", "request_checkpoint", "request_stop"]


def _control_dir(run_dir: Path) -> Path:
    return run_dir / "control"


def request_stop(run_dir: Path, signal_name: str | None = None) -> None:
    """Ask every local rank to finish its step, save a final checkpoint and exit.

    Args:
        run_dir: the per-run directory.
        signal_name: the signal that stopped the daemon (`SIGTERM`), which the ranks log;
            None when no signal did (a node waits to join an elastic job).
    """
    path = _control_dir(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    # Written whole before it appears: a rank that sees the file reads the name with it.
    tmp = path / f".stop.{os.getpid()}.tmp"
    tmp.write_text(signal_name or "")
    os.replace(tmp, path / "stop")


def clear_stop(run_dir: Path) -> None:
    """Withdraw a stop request once its ranks have stopped, so the next group trains.

    An elastic daemon asks its ranks to stop for a membership change and then starts a new
    group on the same run directory; a stop file left there would end that group at once.
    """
    (_control_dir(run_dir) / "stop").unlink(missing_ok=True)


def request_checkpoint(run_dir: Path) -> int:
    """Ask every local rank for a checkpoint at the next step boundary; returns the request id."""
    path = _control_dir(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    counter = path / "checkpoint"
    try:
        current = int(counter.read_text() or "0")
    except (OSError, ValueError):
        current = 0
    tmp = path / f".checkpoint.{os.getpid()}.tmp"
    tmp.write_text(str(current + 1))
    os.replace(tmp, counter)
    return current + 1


class RankControl:
    """A rank's view of stop/checkpoint requests.

    Args:
        run_dir: the per-run directory, or None when no daemon supervises this rank.
        graceful_signals: turn SIGTERM/SIGINT into stop requests (else they keep their default
            action); SIGUSR1 always becomes a checkpoint request. Main thread only.
    """

    def __init__(self, run_dir: Path | None, *, graceful_signals: bool = True) -> None:
        self._dir = _control_dir(run_dir) if run_dir is not None else None
        self._stop = threading.Event()
        self._checkpoint = threading.Event()
        self._seen_counter = self._read_counter()
        self.stop_signal: str | None = None
        """Name of the signal that asked this rank, or its daemon, to stop; None: none did."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_checkpoint_signal)
            if graceful_signals:
                signal.signal(signal.SIGTERM, self._on_stop_signal)
                signal.signal(signal.SIGINT, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signal.Signals(signum).name
        self._stop.set()

    def _on_checkpoint_signal(self, signum: int, frame: FrameType | None) -> None:
        self._checkpoint.set()

    def _read_counter(self) -> int:
        if self._dir is None:
            return 0
        try:
            return int((self._dir / "checkpoint").read_text() or "0")
        except (OSError, ValueError):
            return 0

    def _check_stop_file(self) -> None:
        if self._dir is None or self._stop.is_set() or not (self._dir / "stop").exists():
            return
        try:
            name = (self._dir / "stop").read_text().strip()
        except OSError:
            name = ""  # the request stands even when its signal's name cannot be read
        if self.stop_signal is None and name:
            self.stop_signal = name
        self._stop.set()

    def stop_requested(self) -> bool:
        """Whether a stop was requested (checkpoint requests are left for `poll`)."""
        self._check_stop_file()
        return self._stop.is_set()

    def poll(self) -> tuple[bool, bool]:
        """`(stop, checkpoint)` requested locally since the last poll (checkpoint is consumed)."""
        if self._dir is not None:
            self._check_stop_file()
            counter = self._read_counter()
            if counter != self._seen_counter:
                self._seen_counter = counter
                self._checkpoint.set()
        checkpoint = self._checkpoint.is_set()
        self._checkpoint.clear()
        return self._stop.is_set(), checkpoint
