"""A phase that lasts is published, a quick one is not (`daemon/rank/phase_watch.py`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from daemon.rank.phase_watch import PhaseWatch
from daemon.rank.telemetry import RankTelemetry
from daemon.rundir.snapshot import RankPhase, read_snapshot, snapshot_path


def _wait(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_watch_publishes_once_after_the_deadline_and_never_when_disarmed() -> None:
    now = [0.0]
    published = threading.Event()
    watch = PhaseWatch(published.set, linger_s=0.05, clock=lambda: now[0])
    try:
        watch.arm()
        time.sleep(0.2)  # several ticks of the thread; the clock has not moved
        assert watch.disarm() is False
        now[0] = 10.0
        time.sleep(0.2)
        assert not published.is_set()  # disarmed: nothing to publish
        watch.arm()
        now[0] = 20.0
        assert published.wait(10.0)
        assert watch.disarm() is True
    finally:
        watch.close()


def _phase(path: Path) -> RankPhase | None:
    data = read_snapshot(path)
    return None if data is None else data["phase"]


def test_a_blocked_checkpoint_call_is_published_as_checkpointing(tmp_path: Path) -> None:
    path = snapshot_path(tmp_path, 0)
    telemetry = RankTelemetry(path, rank=0, world_size=1)
    try:
        telemetry.heartbeat(RankPhase.TRAINING)
        assert _phase(path) is RankPhase.TRAINING
        release = threading.Event()

        def blocked_save() -> None:
            with telemetry.in_phase(RankPhase.CHECKPOINTING):
                release.wait(30.0)

        saver = threading.Thread(target=blocked_save)
        saver.start()
        _wait(lambda: _phase(path) is RankPhase.CHECKPOINTING)
        release.set()
        saver.join(30.0)
        # Leaving a published phase publishes the one it returns to.
        assert _phase(path) is RankPhase.TRAINING
        assert telemetry.phase is RankPhase.TRAINING
    finally:
        telemetry.close()


def test_a_call_that_raises_leaves_the_rank_in_its_phase(tmp_path: Path) -> None:
    telemetry = RankTelemetry(None, rank=0, world_size=1)
    telemetry.heartbeat(RankPhase.TRAINING)
    with pytest.raises(OSError, match="disk full"), telemetry.in_phase(RankPhase.CHECKPOINTING):
        raise OSError("disk full")
    assert telemetry.phase is RankPhase.CHECKPOINTING
    telemetry.close()
