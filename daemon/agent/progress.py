"""The node's progress as people and log readers see it: a live status line, or progress events.

Both sinks are fed by the supervisor thread (`observe`, every tick) with the same rank views the
status page uses, and read the rates and ETA from the `StatusBoard`:

* On a terminal (stderr a TTY, console logs) `LiveProgress` keeps one status line at the bottom
  of the screen with rich's `Live`: phase, step N/M, loss, tokens/s, ETA, last committed
  checkpoint, restarts. [Note: one writer to the terminal] A line written by anyone else while
  the status line is drawn would land in the middle of it, so the daemon's console is the only
  writer: the daemon's own log records go through `log_stream()`, the ranks' output (redirected
  to files by the elastic agent, see `relay.py`) through `print_line()`, and both are printed
  above the status line, which is then redrawn below them.
* Off a terminal (journald, kubelet, a pipe) `ProgressEvents` logs one structured `progress`
  event every `log_every_s` seconds with the same fields, in the node's log format.
"""

from __future__ import annotations

import sys
import threading
from typing import NamedTuple, Protocol, TextIO, cast

import structlog
from rich.console import Console
from rich.file_proxy import FileProxy
from rich.live import Live
from rich.text import Text

from daemon.observe.collector import RankView
from daemon.observe.state import NodeStatus
from daemon.observe.status import StatusBoard, format_duration

__all__ = [
    "LiveProgress",
    "Progress",
    "ProgressEvents",
    "ProgressSink",
    "format_progress",
    "read_progress",
]

log = structlog.get_logger("trainingd.progress")

_REFRESH_PER_S = 4


class Progress(NamedTuple):
    """One reading of the node's progress (the fields of a `progress` event)."""

    phase: str
    """The node phase (`training`, `checkpointing`, ...)."""
    step: int | None
    """Lowest current step of the local ranks (None before the first report)."""
    max_steps: int
    """The run's target step."""
    loss: float | None
    """Global mean loss of the last step."""
    tokens_per_s: float
    """Tokens/s of this node over the last few seconds."""
    eta_s: float | None
    """Seconds to `max_steps` at the current pace (None until known)."""
    last_committed_step: int | None
    """Step of the newest committed checkpoint this run saw."""
    restarts: int
    """Worker-group restarts on this node."""


def read_progress(views: list[RankView], status: NodeStatus, board: StatusBoard) -> Progress:
    """The progress the node shows now, from its ranks' views, its state and the board."""
    loss = next((x for v in views if (x := v.gauge("trainingd_train_loss")) is not None), None)
    committed = [
        int(x) for v in views if (x := v.gauge("trainingd_ckpt_last_committed_step")) is not None
    ]
    tokens_per_s, _ = board.rates()
    return Progress(
        phase=status.phase.value,
        step=status.step,
        max_steps=board.max_steps,
        loss=None if loss is None else round(loss, 4),
        tokens_per_s=round(tokens_per_s, 1),
        eta_s=None if (eta := board.eta_s()) is None else round(eta, 1),
        last_committed_step=max(committed, default=None),
        restarts=status.restarts,
    )


def format_progress(p: Progress) -> str:
    """The status line: `[trainingd] training | step 120/300 | loss 1.2345 | ... | restarts 0`."""
    parts = [f"[trainingd] {p.phase}", f"step {_or_dash(p.step)}/{p.max_steps}"]
    parts.append("loss -" if p.loss is None else f"loss {p.loss:.4f}")
    parts.append(f"{p.tokens_per_s:,.0f} tok/s")
    parts.append(f"ETA {format_duration(p.eta_s)}")
    parts.append(f"last ckpt {_or_dash(p.last_committed_step)}")
    parts.append(f"restarts {p.restarts}")
    return " | ".join(parts)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


class ProgressSink(Protocol):
    """Where the supervisor sends the node's progress every tick."""

    def observe(self, views: list[RankView], status: NodeStatus, now: float) -> None:
        """Take in one supervisor tick (`now`: monotonic seconds)."""
        ...

    def finish(self) -> None:
        """The ranks have ended and a tick after that was observed: show the run's end."""
        ...


class ProgressEvents:
    """Logs a `progress` event every `every_s` seconds (off a terminal).

    Args:
        board: the node's status board (rates, ETA, max_steps).
        every_s: seconds between two events (`log_every_s`).
    """

    def __init__(self, board: StatusBoard, every_s: float) -> None:
        self._board = board
        self._every_s = every_s
        self._last: float | None = None
        self._latest: tuple[list[RankView], NodeStatus] | None = None
        self._finished = False
        self._lock = threading.Lock()  # ticks on the supervisor's thread, `finish` on main

    def observe(self, views: list[RankView], status: NodeStatus, now: float) -> None:
        """Log an event when `every_s` has passed since the last (the first tick starts it)."""
        with self._lock:
            if self._finished:
                return
            self._latest = (views, status)
            if self._last is None:
                self._last = now
                return
            if now - self._last < self._every_s:
                return
            self._last = now
        log.info("progress", **read_progress(views, status, self._board)._asdict())

    def finish(self) -> None:
        """Log the last progress seen, once: a run shorter than `every_s` (or ending between two
        events) still leaves its final step in the log; nothing is logged after it."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            latest = self._latest
        if latest is not None:
            log.info("progress", **read_progress(*latest, self._board)._asdict())


class LiveProgress:
    """The live status line on a terminal, and the only way text reaches that terminal.

    See [Note: one writer to the terminal]. Start it before anything else can print to the
    terminal through it, `close()` it before printing the run's ending.

    Args:
        board: the node's status board (rates, ETA, max_steps).
        file: the terminal (default: stderr).
    """

    def __init__(self, board: StatusBoard, file: TextIO | None = None) -> None:
        self._board = board
        self._console = Console(file=file or sys.stderr)
        self._line = Text(f"[trainingd] starting | step -/{board.max_steps}", no_wrap=True)
        self._live = Live(
            get_renderable=lambda: self._line,
            console=self._console,
            refresh_per_second=_REFRESH_PER_S,
            # The line goes with the display: the ending is printed where it stood.
            transient=True,
            # Stray writes to sys.stderr (warnings, torch's Python-side prints) go above it too.
            redirect_stderr=True,
            redirect_stdout=False,
        )
        self._proxy = FileProxy(self._console, self._console.file)
        self._closed = False

    def start(self) -> LiveProgress:
        """Draw the line; returns self."""
        self._live.start()
        # Live hides the cursor until stop(); an abrupt exit (a second SIGINT exits at once,
        # SIGKILL) would leave the user's shell without one. Shown, it blinks after the line.
        self._console.show_cursor(True)
        return self

    def log_stream(self) -> TextIO:
        """A text stream whose lines are printed above the status line (for the log handler).

        Reports `isatty()` True, so console logs written to it keep their colours.
        """
        return cast(TextIO, self._proxy)

    def print_line(self, line: str) -> None:
        """Print one line (ANSI colours kept) above the status line."""
        self._console.print(Text.from_ansi(line))

    def observe(self, views: list[RankView], status: NodeStatus, now: float) -> None:
        """Redraw the status line from the current progress (at the next refresh)."""
        line = format_progress(read_progress(views, status, self._board))
        self._line = Text(line, no_wrap=True, overflow="ellipsis")

    def finish(self) -> None:
        """Nothing: the line shows the last tick until `close()` prints the run's ending."""

    def close(self) -> None:
        """Remove the status line and give the terminal back (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._proxy.flush()
        self._live.stop()
