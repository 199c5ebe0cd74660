"""The node's progress: the live status line on a terminal, `progress` events off it.

The terminal test runs a real `trainingd run` inside tmux (its own server, a fixed-size window)
and reads the screen with `capture-pane` while it trains: the status line shows step N/M and an
ETA, and no line of the screen ever holds both a log record and the status line (the ranks'
records included: they are separate processes, relayed through the daemon).
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import structlog

from daemon.agent.progress import LiveProgress, Progress, ProgressEvents, format_progress
from daemon.observe.collector import SnapshotAggregator
from daemon.observe.state import NodeState
from daemon.observe.status import StatusBoard
from daemon.rank.telemetry import RankTelemetry
from daemon.rundir.snapshot import RankPhase, snapshot_path
from tests.daemon import _gated_job
from tests.daemon._daemon_proc import GATED_JOB, REPO, TRAININGD, Gate, wait_for

STATUS_LINE = re.compile(
    r"^\[trainingd\] [a-z]+ \| step (\d+|-)/(\d+) \| loss (\S+) \| [\d,]+ tok/s "
    r"\| ETA (-|(?:\d+h )?(?:\d+m )?\d+s) \| last ckpt (\d+|-) \| restarts \d+ *$"
)
"""The whole of a screen line that holds the status line: nothing before it, nothing after."""
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
"""A console log record starts with its ISO timestamp."""


def test_status_line_format() -> None:
    p = Progress(
        phase="training",
        step=120,
        max_steps=300,
        loss=1.23456,
        tokens_per_s=3456.7,
        eta_s=62.0,
        last_committed_step=100,
        restarts=1,
    )
    line = format_progress(p)
    assert line == (
        "[trainingd] training | step 120/300 | loss 1.2346 | 3,457 tok/s | ETA 1m 2s "
        "| last ckpt 100 | restarts 1"
    )
    assert STATUS_LINE.match(line)
    early = p._replace(phase="rendezvous", step=None, loss=None, eta_s=None)
    early = early._replace(last_committed_step=None, tokens_per_s=0.0)
    assert format_progress(early) == (
        "[trainingd] rendezvous | step -/300 | loss - | 0 tok/s | ETA - | last ckpt - | restarts 1"
    )
    assert STATUS_LINE.match(format_progress(early))


def test_progress_events_every_log_every_s_with_the_status_fields(tmp_path: Path) -> None:
    clock = [1000.0]
    board = StatusBoard(
        max_steps=50, ckpt_uri=str(tmp_path), clock=lambda: clock[0], list_checkpoints=list
    )
    state = NodeState(local_ranks=1)
    tel = RankTelemetry(snapshot_path(tmp_path, 0), rank=0, world_size=1)
    events = ProgressEvents(board, every_s=10.0)
    aggregator = SnapshotAggregator(tmp_path, 1)

    def tick(now: float, step: int) -> None:
        clock[0] = 1000.0 + now
        tel.set("trainingd_train_step", step)
        tel.set("trainingd_train_loss", 2.0 - step / 100)
        tel.set("trainingd_ckpt_last_committed_step", step // 10 * 10)
        tel.inc("trainingd_train_tokens_total", 64)
        tel.heartbeat(RankPhase.TRAINING)
        tel.publish(force=True)
        views = aggregator.refresh()
        status = state.update(step=step, restarts=0)
        board.observe(views, status)
        events.observe(views, status, now)

    with structlog.testing.capture_logs() as logs:
        for i in range(26):  # one tick per second, one step per tick
            tick(float(i), i)
    progress = [e for e in logs if e["event"] == "progress"]
    assert len(progress) == 2  # at 10 s and 20 s (the first tick starts the clock)
    last = progress[-1]
    assert last["step"] == 20
    assert last["max_steps"] == 50
    assert last["loss"] == pytest.approx(1.8)
    assert last["tokens_per_s"] == pytest.approx(64.0)
    assert last["eta_s"] == pytest.approx(30.0)  # 30 steps left at 1 step/s
    assert last["last_committed_step"] == 20
    assert last["restarts"] == 0
    assert last["phase"] == "starting"
    # The run ends 5 s after the last event: its final step is logged once, at the end, and
    # nothing after it (a 3-step run used to end between two events with no step in the log).
    with structlog.testing.capture_logs() as logs:
        events.finish()
        events.finish()
        tick(40.0, 40)
    assert [(e["event"], e["step"]) for e in logs] == [("progress", 25)]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_line_prints_lines_above_itself_and_leaves_a_cursor(tmp_path: Path) -> None:
    term = _Terminal()
    board = StatusBoard(max_steps=5, ckpt_uri=str(tmp_path), list_checkpoints=list)
    live = LiveProgress(board, file=term).start()
    live.print_line("rank line \x1b[31mred\x1b[0m")
    live.log_stream().write("daemon record\n")
    live.close()
    live.close()  # idempotent
    out = term.getvalue()
    status = "[trainingd] starting | step -/5"
    # Each printed line ends with a newline and the status line is drawn again after it.
    assert "rank line \x1b[31mred\x1b[0m\n" + status in out
    assert "daemon record\n" + status in out
    # The cursor is shown again right after Live hides it (an abrupt exit keeps a cursor) ...
    assert out.index("\x1b[?25h") == out.index("\x1b[?25l") + len("\x1b[?25l")
    # ... and the line is erased at the end: the run's ending is printed where it stood.
    assert out.endswith("\x1b[1A\x1b[2K")


def _both_held(directory: Path) -> bool:
    return all(_gated_job.held_marker(directory, rank, 0).exists() for rank in (0, 1))


def _status_step(line: str) -> int:
    """The step a status line of the 40-step run shows (-1: not one, or no step yet)."""
    m = STATUS_LINE.match(line)
    return int(m[1]) if m is not None and m[1] != "-" and m[2] == "40" else -1


def _tmux(socket: str, *args: str) -> str:
    out = subprocess.run(
        ["tmux", "-L", socket, "-f", os.devnull, *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout


@pytest.mark.tmux
@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(400)
def test_terminal_shows_one_live_status_line_below_every_log_line(tmp_path: Path) -> None:
    socket = f"trainingd-test-{os.getpid()}"
    exit_file = tmp_path / "exit"
    run = [
        str(TRAININGD), "run", "--nproc-per-node", "2", "--batch-size", "4",
        "--warmup-steps", "1", "--max-steps", "40", "--ckpt-every", "10",
        "--metrics-port", "0", "--ckpt-uri", str(tmp_path / "ckpt"),
        "--memory-dir", str(tmp_path / "shm"), "--publish-interval-s", "0.2", *GATED_JOB,
    ]  # fmt: skip
    # 40 steps take a few seconds, fewer than a loaded machine's captures may need: the ranks
    # are held after step 10 until a screen has shown the status line with a step, or for
    # 10 s (it shows the last step the ranks published, every 0.2 s, and none while held).
    gate = Gate(tmp_path / "gate", after_steps=10, batch_size=4)
    # The shell keeps the window open after the run so the last screen can be read.
    script = f"{shlex.join(run)}; echo EXIT=$? > {shlex.quote(str(exit_file))}; sleep 600"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAININGD_", "TMUX"))}
    env.pop("NOTIFY_SOCKET", None)
    env.update(gate.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    subprocess.run(
        ["tmux", "-L", socket, "-f", os.devnull, "new-session", "-d", "-s", "t",
         "-x", "200", "-y", "50", "-c", str(REPO), script],
        env=env, check=True, timeout=30,
    )  # fmt: skip
    screens: list[list[str]] = []
    opened = False
    held_since: float | None = None
    try:
        deadline = time.monotonic() + 360
        while not exit_file.exists() and time.monotonic() < deadline:
            screen = _tmux(socket, "capture-pane", "-p", "-t", "t").splitlines()
            screens.append(screen)
            if not opened and held_since is None and _both_held(gate.directory):
                held_since = time.monotonic()
            # Open once a screen showed a step while they are held, or 10 s into the hold
            # (well inside the hang timeout): the rest of the run is then seen unheld.
            if (
                not opened
                and held_since is not None
                and (
                    any(_status_step(line) > 0 for line in screen)
                    or time.monotonic() - held_since > 10
                )
            ):
                gate.open()
                opened = True
            time.sleep(0.3)
        wait_for(exit_file.exists, 10, "the run to end")
        history = _tmux(socket, "capture-pane", "-p", "-t", "t", "-S", "-").splitlines()
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], check=False, timeout=30)
    final = "\n".join(history)
    assert opened, final  # the ranks reached the hold
    assert exit_file.read_text().strip() == "EXIT=0", final

    lines = [line for screen in screens for line in screen]
    status = [m for line in lines if (m := STATUS_LINE.match(line))]
    # Training was seen: a step of 40 and an ETA in seconds.
    assert any(m[1] != "-" and int(m[1]) > 0 and m[2] == "40" for m in status), final
    assert any(m[4] != "-" for m in status), final
    # The status line is always alone on its line, and always the last line written.
    mixed = [line for line in lines if "| ETA " in line and not STATUS_LINE.match(line)]
    assert not mixed, mixed
    assert not [line for line in lines if LOG_RECORD.search(line) and "| ETA " in line]
    for screen in screens:
        drawn = [i for i, line in enumerate(screen) if STATUS_LINE.match(line)]
        assert len(drawn) <= 1, screen
        if drawn:
            assert all(not line.strip() for line in screen[drawn[0] + 1 :]), screen

    # The ranks' records (separate processes) reached the terminal through the daemon.
    assert re.search(r"\[info\s*\] training .*rank=1", final), final
    assert re.search(r"\[info\s*\] daemon_started ", final), final
    # The status line went away; the ending is the last thing on the screen.
    assert not [line for line in history if STATUS_LINE.match(line)], final
    assert "finished at step 40 of 40" in final
    assert "trainingd: sample of the trained model:" in final
    # The prompt, indented; what follows it is the trained model's text (any characters).
    assert "\n    The daemon" in final
