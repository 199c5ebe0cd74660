"""The incident watch: a failed attempt declared once, its restart seen through to a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.agent.failures import FailureTracker, RankExit, Verdict
from daemon.agent.incident_watch import IncidentWatch
from daemon.observe.collector import RankView
from daemon.observe.incidents import IncidentKind, IncidentLog, IncidentState
from daemon.rundir.failure import error_path, rank_error, write_error
from daemon.rundir.progress import ProgressPhase, ProgressWord, progress_path
from daemon.rundir.snapshot import RankPhase


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _view(
    local: int,
    pid: int,
    *,
    restart: int,
    step: int,
    steps_total: float,
    recovered: bool = False,
    memory_restores: int = 0,
    beat: float = 0.0,
) -> RankView:
    gauges = {"trainingd_train_step": {"": float(step)}}
    if recovered:
        gauges["trainingd_rank_recovery_seconds"] = {"": 2.0}
    if beat:
        gauges["trainingd_rank_heartbeat_timestamp_seconds"] = {"": beat}
    histograms = {}
    if memory_restores:
        histograms["trainingd_rank_restart_recovery_seconds"] = {
            "memory": ([0, memory_restores, 0], 2.0 * memory_restores)
        }
    return RankView(
        rank=local,
        local_rank=local,
        pid=pid,
        restart=restart,
        world_size=2,
        phase=RankPhase.TRAINING,
        counters={"trainingd_train_steps_total": {"": steps_total}},
        gauges=gauges,
        histograms=histograms,
    )


@pytest.fixture
def words(tmp_path: Path) -> list[ProgressWord]:
    (tmp_path / "ranks").mkdir()
    made = [ProgressWord(progress_path(tmp_path, k)) for k in (0, 1)]
    yield made
    for word in made:
        word.close()


def test_a_killed_rank_is_one_incident_closed_by_the_restarts_first_step(
    tmp_path: Path, words: list[ProgressWord]
) -> None:
    clock = _Clock(1000.0)
    dead: set[int] = set()
    incidents = IncidentLog(node=0, clock=clock)
    watch = IncidentWatch(
        incidents, tmp_path, local_ranks=2, clock=clock, alive=lambda pid: pid not in dead
    )
    tracker = FailureTracker(tmp_path, node=0, local_ranks=2, incidents=watch)
    words[0].mark(ProgressPhase.DATA, 10)
    words[1].mark(ProgressPhase.COLLECTIVE, 10)
    old = [_view(k, 10 + k, restart=0, step=9, steps_total=9.0) for k in (0, 1)]
    watch.observe(old)
    # Rank 0 dies; the next tick sees it gone, the agent reports it a little later.
    dead.add(10)
    clock.now = 1000.25
    watch.observe(old)
    clock.now = 1000.5
    assert tracker.record([RankExit(0, 0, -9)], restart=0) is Verdict.RETRY
    (opened,) = incidents.recent()
    assert (opened.kind, opened.ranks, opened.state) == (
        IncidentKind.RANK_FAILURE,
        (0,),
        IncidentState.OPEN,
    )
    assert opened.cause == "rank 0 (node 0): killed by SIGKILL"
    assert opened.detection_s == pytest.approx(0.25)
    assert opened.step_before == 10  # the progress words, ahead of the published step 9
    # The new incarnation restores step 9 from memory; before its first step nothing closes.
    clock.now = 1002.0
    starting = [_view(k, 20 + k, restart=1, step=9, steps_total=9.0) for k in (0, 1)]
    watch.observe(starting)
    assert incidents.recent()[0].state is IncidentState.OPEN
    # Its first steps: counters continue the old incarnation's (9 + 3 own steps).
    clock.now = 1003.5
    stepped = [
        _view(
            k,
            20 + k,
            restart=1,
            step=12,
            steps_total=12.0,
            recovered=True,
            memory_restores=1,
            beat=1003.0,
        )
        for k in (0, 1)
    ]
    watch.observe(stepped)
    (closed,) = incidents.recent()
    assert closed.state is IncidentState.RECOVERED
    assert closed.recovery_s == pytest.approx(2.5)  # declared 1000.5 -> first step beat 1003.0
    assert (closed.restored_step, closed.source, closed.steps_lost) == (9, "memory", 1)


def test_the_same_error_twice_is_a_fatal_deterministic_incident(
    tmp_path: Path, words: list[ProgressWord]
) -> None:
    incidents = IncidentLog(node=0, clock=_Clock(10.0))
    watch = IncidentWatch(incidents, tmp_path, local_ranks=1, clock=_Clock(10.0))
    tracker = FailureTracker(tmp_path, node=0, local_ranks=1, incidents=watch)
    for attempt in (0, 1):
        err = rank_error(
            ValueError("boom"),
            rank=0,
            local_rank=0,
            restart=attempt,
            phase="training",
            step=3,
            config=False,
        )
        write_error(error_path(tmp_path, 0), err)
        verdict = tracker.record([RankExit(0, 0, 1)], restart=attempt)
    assert verdict is Verdict.DETERMINISTIC
    newest, first = incidents.recent()
    assert (first.kind, first.state) == (IncidentKind.RANK_FAILURE, IncidentState.OPEN)
    assert (newest.kind, newest.state) == (IncidentKind.DETERMINISTIC, IncidentState.FATAL)
    assert newest.cause == "rank 0 (node 0) at step 3: ValueError: boom"
    assert newest.detection_s is not None  # the error file's time


def test_ranks_killed_by_the_hang_detector_belong_to_the_hang(
    tmp_path: Path, words: list[ProgressWord]
) -> None:
    incidents = IncidentLog(node=0, clock=_Clock(10.0))
    watch = IncidentWatch(incidents, tmp_path, local_ranks=2, clock=_Clock(10.0))
    tracker = FailureTracker(
        tmp_path, node=0, local_ranks=2, incidents=watch, hung=lambda: {0: True}
    )
    tracker.record([RankExit(0, 0, -9), RankExit(1, 1, -9)], restart=0)
    assert incidents.recent() == []
    # The agent may see only the killed waiter: with the hang's incident open, it is the hang's.
    hang = incidents.open(IncidentKind.HANG, ranks=[0], cause="rank 0 hung")
    alone = FailureTracker(tmp_path, node=0, local_ranks=2, incidents=watch)
    alone.record([RankExit(1, 1, -9)], restart=1)
    assert incidents.recent() == [hang]
    alone.record([RankExit(1, 1, -6)], restart=2)  # killed by something else than the detector
    assert incidents.recent()[0].kind is IncidentKind.RANK_FAILURE


def test_ranks_that_only_lost_a_peer_are_a_peer_lost_incident(tmp_path: Path) -> None:
    # Another node's rank died: this node's rank raised only gloo's lost-connection error.
    incidents = IncidentLog(node=1, clock=_Clock(1000.0))
    watch = IncidentWatch(incidents, tmp_path, local_ranks=1, clock=_Clock(1000.0))
    tracker = FailureTracker(tmp_path, node=1, local_ranks=1, incidents=watch)
    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:4")
    except RuntimeError as err:
        error = rank_error(
            err, rank=1, local_rank=0, restart=0, phase="training", step=7, config=False
        )
    (tmp_path / "ranks").mkdir(exist_ok=True)
    write_error(error_path(tmp_path, 0), error)
    assert tracker.record([RankExit(0, 1, 1)], restart=0) is Verdict.RETRY
    (opened,) = incidents.recent()
    assert (opened.kind, opened.ranks, opened.state) == (
        IncidentKind.PEER_LOST,
        (1,),
        IncidentState.OPEN,
    )
    assert "Connection closed by peer" in opened.cause
