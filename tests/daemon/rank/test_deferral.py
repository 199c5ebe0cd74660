"""Deferred durable saves: each counted once, one log line per episode, the owed save paid."""

from __future__ import annotations

import structlog

from ckpt_manager import ManagerStats
from daemon.rank.deferral import DeferredSaves
from daemon.rank.telemetry import RankTelemetry


def _stats(inflight_step: int | None, since: float | None) -> ManagerStats:
    return ManagerStats(
        inflight=1,
        last_committed_step=None,
        last_committed_unix_s=None,
        oldest_inflight_step=inflight_step,
        oldest_inflight_unix_s=since,
    )


def test_each_due_save_counts_once_and_an_episode_logs_once_at_each_end() -> None:
    clock = [100.0]
    telemetry = RankTelemetry(None, rank=0, world_size=2)
    deferred = DeferredSaves(telemetry, clock=lambda: clock[0])
    assert not deferred.owed
    deferred.taken(4)  # nothing owed: nothing to report
    with structlog.testing.capture_logs() as events:
        deferred.defer(10, _stats(8, 97.5), due=True)
        clock[0] += 1.0
        for step in (11, 12, 13):  # owed, still busy; 12 is due again
            deferred.defer(step, _stats(8, 97.5), due=step == 12)
        assert deferred.owed
        assert deferred.first_step == 10
        clock[0] += 1.0
        deferred.taken(14)
    assert not deferred.owed
    counters = telemetry.snapshot()["counters"]["trainingd_ckpt_saves_total"]
    assert counters == {"deferred": 2.0}
    names = [e["event"] for e in events]
    assert names == ["checkpoint_deferred", "checkpoint_caught_up"], events
    start, end = events
    assert (start["ckpt_step"], start["inflight_step"], start["inflight_s"]) == (10, 8, 2.5)
    assert end["ckpt_step"] == 14
    assert end["deferred_from_step"] == 10
    assert end["num_deferred"] == 2
    assert end["deferred_s"] == 2.0
    # A new episode logs again and counts from zero.
    with structlog.testing.capture_logs() as events:
        deferred.defer(20, _stats(None, None), due=True)
        deferred.taken(21)
    assert [e["event"] for e in events] == ["checkpoint_deferred", "checkpoint_caught_up"]
    assert events[0]["inflight_s"] is None
    assert events[1]["num_deferred"] == 1
    assert telemetry.snapshot()["counters"]["trainingd_ckpt_saves_total"] == {"deferred": 3.0}
