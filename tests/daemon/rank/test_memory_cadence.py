"""The memory tier's cadence: fixed intervals, and `auto` fed synthetic timings."""

from __future__ import annotations

import itertools
import random

import pytest

from daemon.config import StepInterval
from daemon.rank.memory_cadence import AdaptiveCadence, FixedCadence, cadence_for


def _run(cadence: AdaptiveCadence, steps: range, step_s: float, snapshot_s: float) -> list[int]:
    """Train `steps` with constant timings; the steps snapshotted."""
    done = []
    for step in steps:
        cadence.observe_step(step_s)
        if cadence.due(step):
            cadence.observe_snapshot(step, snapshot_s)
            done.append(step)
    return done


def test_fixed_and_off_and_the_setting_picks_the_kind() -> None:
    every3 = cadence_for(StepInterval(3))
    assert isinstance(every3, FixedCadence)
    assert [s for s in range(1, 10) if every3.due(s)] == [3, 6, 9]
    off = cadence_for(StepInterval(0))
    assert off.interval == 0
    assert not any(off.due(s) for s in range(1, 100))
    assert isinstance(cadence_for(StepInterval()), AdaptiveCadence)
    with pytest.raises(ValueError, match="memory_every=-1"):
        FixedCadence(-1)


def test_auto_starts_safe_then_picks_the_smallest_interval_within_2_percent() -> None:
    cadence = AdaptiveCadence(headroom=0.0)  # aim at the budget itself
    assert cadence.interval == 10  # nothing measured yet
    cadence.observe_step(0.1)
    assert cadence.interval == 10  # no snapshot cost known
    # 10 ms per snapshot on 100 ms steps: 10% of one step, so 5 steps amortize it to 2%.
    done = _run(cadence, range(1, 60), step_s=0.1, snapshot_s=0.01)
    assert done[0] == 10
    assert cadence.interval == 5
    assert cadence.cost_ratio(5) == pytest.approx(0.02)
    assert cadence.cost_ratio(4) > 0.02  # the smallest such interval
    assert all(b - a == 5 for a, b in itertools.pairwise(done[1:]))
    # A snapshot that costs nothing next to the step: every step.
    # With the default headroom it aims 10% under: 10% of a step / 1.8% -> 6 steps.
    aiming = AdaptiveCadence()
    _run(aiming, range(1, 60), step_s=0.1, snapshot_s=0.01)
    assert aiming.interval == 6
    cheap = AdaptiveCadence()
    _run(cheap, range(1, 40), step_s=1.0, snapshot_s=0.001)
    assert cheap.interval == 1
    # One far dearer than a step: bounded by max_interval.
    dear = AdaptiveCadence(max_interval=200)
    _run(dear, range(1, 40), step_s=0.01, snapshot_s=10.0)
    assert dear.interval == 200


def test_auto_follows_a_change_up_at_once_and_down_with_hysteresis() -> None:
    # No averaging (each change is seen at once), aimed at the budget itself.
    cadence = AdaptiveCadence(smoothing=1.0, headroom=0.0)
    _run(cadence, range(1, 30), step_s=0.1, snapshot_s=0.01)
    assert cadence.interval == 5
    # Snapshots get dearer (a bigger state): the budget breaks, the interval goes up now.
    cadence.observe_snapshot(30, 0.03)
    assert cadence.interval == 15
    # Slightly cheaper: 14 would do, but it comes down only to an interval costing at most
    # 80% of the budget (1.6%), which is 18 here: it stays.
    cadence.observe_snapshot(45, 0.028)
    assert cadence.aimed_interval() == 14
    assert cadence.interval == 15
    # Much cheaper: it comes down to the smallest interval costing at most 1.6%.
    cadence.observe_snapshot(60, 0.01)
    assert cadence.interval == 7
    assert cadence.cost_ratio(7) <= 0.016 < cadence.cost_ratio(6)


def test_noisy_timings_neither_flap_nor_break_the_budget() -> None:
    rng = random.Random(0)
    cadence = AdaptiveCadence()
    intervals = []
    for step in range(1, 2001):
        # Steps of 100 ms +-20%, snapshots of 12 ms +-50%: 12% of a step on average, 6 steps
        # within 2%, 7 aimed 10% under.
        cadence.observe_step(0.1 * rng.uniform(0.8, 1.2))
        if cadence.due(step):
            cadence.observe_snapshot(step, 0.012 * rng.uniform(0.5, 1.5))
        intervals.append(cadence.interval)
    settled = intervals[200:]
    changes = sum(a != b for a, b in itertools.pairwise(settled))
    assert changes <= 10, changes
    assert set(settled) <= {6, 7, 8, 9}, sorted(set(settled))
    # Within the budget on the run's true means (12 ms per 100 ms step).
    mean_interval = sum(settled) / len(settled)
    assert 0.012 / (mean_interval * 0.1) <= 0.02
    # Ignored: non-finite or non-positive step times and negative costs.
    before = cadence.interval
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        cadence.observe_step(bad)
    cadence.observe_snapshot(3000, -1.0)
    assert cadence.interval == before


def test_bad_parameters_name_themselves() -> None:
    for kwargs, match in [
        ({"budget_ratio": 0.0}, "budget_ratio"),
        ({"initial": 0}, "initial"),
        ({"min_steps": 0}, "min_steps"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"headroom": -0.1}, "headroom"),
        ({"hysteresis": 1.0}, "hysteresis"),
    ]:
        with pytest.raises(ValueError, match=match):
            AdaptiveCadence(**kwargs)  # type: ignore[arg-type]
