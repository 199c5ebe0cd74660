"""Rank failures classified, counted and judged (`daemon/agent/failures.py`), without ranks.

The error files are written as a rank writes them (`daemon/rundir/failure.py`), from real
exceptions; the end-to-end cases (a job raising at a step, a job whose build fails) are in
`tests/daemon/test_failures_e2e.py`.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from daemon.agent.failures import (
    FailureReason,
    FailureTracker,
    RankExit,
    Verdict,
    failure_reason,
)
from daemon.metrics import RANK_FAILURE_REASONS
from daemon.rundir.failure import RankError, error_path, rank_error, read_error, write_error


def _raised(err: Exception) -> Exception:
    try:
        raise err
    except Exception as caught:
        return caught


def _write(
    run_dir: Path,
    *,
    local_rank: int = 0,
    rank: int = 0,
    restart: int = 0,
    step: int | None = 3,
    err: Exception | None = None,
    config: bool = False,
) -> RankError:
    error = rank_error(
        _raised(err if err is not None else ValueError("boom")),
        rank=rank,
        local_rank=local_rank,
        restart=restart,
        phase="training" if step is not None else "loading",
        step=step,
        config=config,
    )
    write_error(error_path(run_dir, local_rank), error)
    return error


def test_error_file_round_trip_and_tolerant_read(tmp_path: Path) -> None:
    written = _write(tmp_path, err=ValueError("bad value\nsecond line"))
    assert read_error(error_path(tmp_path, 0)) == written
    assert written.exc_type == "ValueError"
    assert written.traceback_tail[-2:] == ["ValueError: bad value", "second line"]
    assert any(line.strip().startswith('File "') for line in written.traceback_tail)
    error_path(tmp_path, 1).write_text('{"schema": 1, "pid": 1')
    assert read_error(error_path(tmp_path, 1)) is None
    error_path(tmp_path, 1).write_text('{"schema": 99}')
    assert read_error(error_path(tmp_path, 1)) is None
    assert read_error(error_path(tmp_path, 2)) is None


def test_reasons_cover_the_metric_label_values() -> None:
    assert tuple(r.value for r in FailureReason) == RANK_FAILURE_REASONS


def test_classification(tmp_path: Path) -> None:
    error = _write(tmp_path)
    oom = error._replace(exc_type="OutOfMemoryError")
    config = error._replace(config=True, step=None)
    assert failure_reason(1, error, hung=False) is FailureReason.EXCEPTION
    assert failure_reason(1, oom, hung=False) is FailureReason.OOM
    assert failure_reason(1, config, hung=False) is FailureReason.CONFIG
    assert failure_reason(-signal.SIGKILL, None, hung=True) is FailureReason.HUNG
    assert failure_reason(-signal.SIGKILL, None, hung=False) is FailureReason.SIGNAL
    assert failure_reason(3, None, hung=False) is FailureReason.EXIT_CODE


def test_the_same_error_at_the_same_step_twice_is_deterministic(tmp_path: Path) -> None:
    tracker = FailureTracker(tmp_path, node=0)
    _write(tmp_path, restart=0)
    assert tracker.record([RankExit(0, 0, 1)], restart=0) is Verdict.RETRY
    _write(tmp_path, restart=1)
    assert tracker.record([RankExit(0, 0, 1)], restart=1) is Verdict.DETERMINISTIC
    assert tracker.counts()["exception"] == 2
    lines = tracker.summary_lines()
    assert lines[0].startswith("failed: the same error on attempts 1 and 2")
    assert "rank 0 (node 0) at step 3: ValueError: boom" in lines[0]
    assert lines[1].startswith("  raised at ")
    assert "test_failures.py:" in lines[1]
    assert len(lines) == 2  # one short block, not a traceback


@pytest.mark.parametrize(
    ("second", "why"),
    [
        ({"step": 4}, "another step"),
        ({"err": ValueError("other")}, "another message"),
        ({"err": KeyError("boom")}, "another type"),
        ({"rank": 1, "local_rank": 1}, "another rank"),
        ({"step": None}, "before training, not the job's configuration"),
    ],
)
def test_a_different_failure_is_retried(
    tmp_path: Path, second: dict[str, object], why: str
) -> None:
    tracker = FailureTracker(tmp_path, node=0)
    _write(tmp_path, restart=0)
    assert tracker.record([RankExit(0, 0, 1)], restart=0) is Verdict.RETRY
    local = int(str(second.get("local_rank", 0)))
    _write(tmp_path, restart=1, **second)  # type: ignore[arg-type]
    exits = [RankExit(local, int(str(second.get("rank", 0))), 1)]
    assert tracker.record(exits, restart=1) is Verdict.RETRY, why


def test_attempts_must_be_consecutive_and_old_files_are_ignored(tmp_path: Path) -> None:
    tracker = FailureTracker(tmp_path, node=0)
    _write(tmp_path, restart=0)
    assert tracker.record([RankExit(0, 0, 1)], restart=0) is Verdict.RETRY
    # Attempt 1 died by a signal: the file on disk is attempt 0's and says nothing of it.
    assert tracker.record([RankExit(0, 0, -signal.SIGKILL)], restart=1) is Verdict.RETRY
    assert tracker.last[-1].reason is FailureReason.SIGNAL
    assert tracker.last[-1].error is None
    _write(tmp_path, restart=2)
    assert tracker.record([RankExit(0, 0, 1)], restart=2) is Verdict.RETRY


def test_a_config_failure_before_training_ends_at_once(tmp_path: Path) -> None:
    board_notes: list[str] = []

    class Board:
        def note_failure(self, failure: object, text: str) -> None:
            board_notes.append(text)

    tracker = FailureTracker(tmp_path, node=2, board=Board())  # type: ignore[arg-type]
    _write(tmp_path, rank=5, step=None, err=RuntimeError("no such model"), config=True)
    assert tracker.record([RankExit(0, 5, 1)], restart=0) is Verdict.CONFIG
    assert tracker.config_line() == (
        "rank 5 (node 2) failed before training: RuntimeError: no such model"
    )
    assert tracker.counts() == {r: float(r == "config") for r in RANK_FAILURE_REASONS}
    assert board_notes == ["rank 5 (node 2) while loading: RuntimeError: no such model"]


def test_hung_ranks_are_named_so(tmp_path: Path) -> None:
    tracker = FailureTracker(tmp_path, node=0, hung=lambda: {1: True})
    exits = [RankExit(0, 0, -signal.SIGKILL), RankExit(1, 1, -signal.SIGKILL)]
    assert tracker.record(exits, restart=0) is Verdict.RETRY
    assert [f.reason for f in tracker.last] == [FailureReason.SIGNAL, FailureReason.HUNG]
    assert tracker.last[0].describe() == "rank 0 (node 0): killed by SIGKILL"
    assert tracker.last_failure_line() == (
        "last failure: rank 1 (node 0): hung (killed by the hang detector)"
    )


def test_every_rank_raising_is_deterministic_whichever_exits_first(tmp_path: Path) -> None:
    # Both ranks raise the same error at step 3 in both attempts; the agent finds rank 0 dead
    # first in attempt 0 and rank 1 first in attempt 1 (rank 0 still unwinding).
    tracker = FailureTracker(tmp_path, node=0, local_ranks=2)
    for restart, first in ((0, 0), (1, 1)):
        for local in (0, 1):
            _write(tmp_path, local_rank=local, rank=local, restart=restart)
        verdict = tracker.record([RankExit(first, first, 1)], restart=restart)
    assert verdict is Verdict.DETERMINISTIC
    assert tracker.counts()["exception"] == 2  # failures the agent saw, not the other files


def test_a_rank_that_lost_its_peer_is_not_blamed_for_the_peers_exception(tmp_path: Path) -> None:
    # Rank 1 raises at step 3; rank 0, waiting in a collective with it, sees the connection
    # close and exits first: the agent finds only rank 0 dead. The failure is rank 1's.
    tracker = FailureTracker(tmp_path, node=0, local_ranks=2)
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:3973. This is typically caused by a remote worker crashing."
    )
    for restart in (0, 1):
        _write(tmp_path, local_rank=0, rank=0, restart=restart, err=gloo)
        _write(tmp_path, local_rank=1, rank=1, restart=restart, err=ValueError("the job fails"))
        verdict = tracker.record([RankExit(0, 0, 1)], restart=restart)
        assert [(f.rank, f.error.exc_type if f.error else None) for f in tracker.last[-1:]] == [
            (1, "ValueError")
        ]
    assert verdict is Verdict.DETERMINISTIC
    assert [f.rank for f in tracker.decisive] == [1]
    assert tracker.counts()["exception"] == 2  # rank 1 once per attempt; rank 0 not counted


def test_a_lost_peer_is_the_failure_when_no_local_rank_raised_otherwise(tmp_path: Path) -> None:
    # The peer that failed is on another node: this node's only evidence is the lost peer.
    tracker = FailureTracker(tmp_path, node=0, local_ranks=1)
    _write(tmp_path, err=RuntimeError("Connection reset by peer"))
    assert tracker.record([RankExit(0, 0, 1)], restart=0) is Verdict.RETRY
    assert [f.rank for f in tracker.last] == [0]
    assert tracker.counts()["exception"] == 1
