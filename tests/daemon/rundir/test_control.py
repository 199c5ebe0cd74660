"""Stop and checkpoint requests travel from the daemon to the ranks as files."""

from __future__ import annotations

from pathlib import Path

from daemon.rundir.control import RankControl, request_checkpoint, request_stop


def test_requests_are_seen_once_and_old_checkpoint_requests_are_ignored(tmp_path: Path) -> None:
    assert request_checkpoint(tmp_path) == 1  # before the rank started: not for this rank
    control = RankControl(tmp_path, graceful_signals=False)
    assert control.poll() == (False, False)
    assert request_checkpoint(tmp_path) == 2
    assert not control.stop_requested()  # does not consume the checkpoint request
    assert control.poll() == (False, True)
    assert control.poll() == (False, False)  # consumed
    request_stop(tmp_path)
    assert control.stop_requested()
    assert control.poll() == (True, False)
    assert control.poll() == (True, False)  # a stop stays requested
    assert RankControl(None, graceful_signals=False).poll() == (False, False)


def test_a_stop_names_the_signal_that_asked_the_daemon_for_it(tmp_path: Path) -> None:
    signalled = RankControl(tmp_path / "a", graceful_signals=False)
    request_stop(tmp_path / "a", "SIGTERM")
    assert signalled.poll() == (True, False)
    assert signalled.stop_signal == "SIGTERM"
    # A stop for a membership change (a node waits to join) names no signal.
    unsignalled = RankControl(tmp_path / "b", graceful_signals=False)
    request_stop(tmp_path / "b")
    assert unsignalled.stop_requested()
    assert unsignalled.stop_signal is None
