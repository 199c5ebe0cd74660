"""The memory tier's cadence: fixed intervals, and `auto` fed synthetic timings."""

from __future__ import annotations

import itertools
import random

import pytest

from daemon.config import StepInterval
from daemon.rank.memory_cadence import AdaptiveCadence, FixedCadence, cadence_for


def _run(cadence: AdaptiveCadence, steps: range, step_s: float, snapshot_s: float) -> list[int]:
    """Train `steps` with constant timings (the stall is the whole cost, no step slows down);
    the steps snapshotted."""
    done = []
    for step in steps:
        cadence.observe_step(step, step_s)
        if cadence.due(step):
            cadence.observe_snapshot(step, snapshot_s, snapshot_s)
            done.append(step)
    return done


def _machine(
    cadence: AdaptiveCadence,
    steps: range,
    *,
    step_s: float,
    fed_s: float,
    stall_s: float,
    slowdown_s: float,
    second_slowdown_s: float = 0.0,
) -> list[int]:
    """Train `steps` on a machine where a snapshot is fed as `fed_s` (stall + staging CPU),
    stalls the training thread `stall_s` and makes the step after it `slowdown_s` longer (and
    the one after that `second_slowdown_s`); the intervals in force after each step."""
    intervals, last = [], None
    for step in steps:
        # The loop feeds each step's time (fence wait excluded) one step late; the order
        # of the calls does not matter to the cadence.
        slower = {1: slowdown_s, 2: second_slowdown_s}.get(step - last if last else 0, 0.0)
        cadence.observe_step(step, step_s + slower)
        if cadence.due(step):
            cadence.observe_snapshot(step, fed_s, stall_s)
            last = step
        intervals.append(cadence.interval)
    return intervals


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
    cadence.observe_step(0, 0.1)
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
    cadence.observe_snapshot(30, 0.03, 0.03)
    assert cadence.interval == 15
    # Slightly cheaper: 14 would do, but it comes down only to an interval costing at most
    # 80% of the budget (1.6%), which is 18 here: it stays.
    cadence.observe_snapshot(45, 0.028, 0.028)
    assert cadence.aimed_interval() == 14
    assert cadence.interval == 15
    # Much cheaper: it comes down to the smallest interval costing at most 1.6%.
    cadence.observe_snapshot(60, 0.01, 0.01)
    assert cadence.interval == 7
    assert cadence.cost_ratio(7) <= 0.016 < cadence.cost_ratio(6)


def test_noisy_timings_neither_flap_nor_break_the_budget() -> None:
    rng = random.Random(0)
    cadence = AdaptiveCadence()
    intervals = []
    for step in range(1, 2001):
        # Steps of 100 ms +-20%, snapshots of 12 ms +-50%: 12% of a step on average, 6 steps
        # within 2%, 7 aimed 10% under.
        cadence.observe_step(step, 0.1 * rng.uniform(0.8, 1.2))
        if cadence.due(step):
            cost = 0.012 * rng.uniform(0.5, 1.5)
            cadence.observe_snapshot(step, cost, cost / 3)
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
        cadence.observe_step(2999, bad)
    cadence.observe_snapshot(3000, -1.0, 0.0)
    cadence.observe_snapshot(3000, 0.01, float("nan"))
    assert cadence.interval == before


def test_auto_counts_what_the_step_after_a_snapshot_loses() -> None:
    # [Note: a snapshot's cost is also measured in the step after it]. Fed 3 ms (1 ms of
    # stall and 2 ms of staging CPU), but the step after each snapshot takes 9 ms longer
    # (its staging shares the cores with training): a snapshot really costs 10 ms of a 100 ms
    # step, so 2% needs an interval of 5 or more (6 aimed 10% under). By the fed cost alone
    # the interval would be 2 and the run 5% slower.
    cadence = AdaptiveCadence()
    for step in range(1, 4):  # the first steps after a start are slow: not the reference
        cadence.observe_step(step, 0.5)
    intervals = _machine(
        cadence, range(4, 400), step_s=0.1, fed_s=0.003, stall_s=0.001, slowdown_s=0.009
    )
    assert cadence.smoothed_excess_s == pytest.approx(0.009, rel=0.05)
    # Within the budget from a few snapshots on (coming up from below, it stops at the first
    # interval within 2%; from above it would stop at the aimed 6).
    assert min(intervals[60:]) >= 5, intervals[:80]
    assert set(intervals[200:]) <= {5, 6}, sorted(set(intervals[200:]))
    assert (0.001 + 0.009) / (5 * 0.1) <= 0.02 + 1e-12
    # Where a spare core takes the staging, no step slows down: the fed cost decides, as
    # before (3 ms / 1.8% of 100 ms -> 2).
    spare = AdaptiveCadence()
    _machine(spare, range(1, 400), step_s=0.1, fed_s=0.003, stall_s=0.001, slowdown_s=0.0)
    assert spare.interval == 2


def test_a_snapshot_that_paid_a_one_time_cost_is_left_out() -> None:
    # [Note: a slot's allocation is not a snapshot's cost] in `loop.py`: the first snapshot
    # allocates the slot files (0.3 s here, and its next step is 0.2 s slower); fed as NaN,
    # neither it nor the step after it moves the cadence, which settles on the recurring
    # 10 ms (stall 1 ms + 9 ms the next step loses): 6 aimed, as on a machine without it.
    cadence = AdaptiveCadence()
    for step in range(1, 10):
        cadence.observe_step(step, 0.1)
    assert cadence.due(10)
    cadence.observe_step(10, 0.1)
    cadence.observe_snapshot(10, float("nan"), float("nan"))
    cadence.observe_step(11, 0.3)  # beside the allocation
    assert cadence.smoothed_snapshot_s is None
    assert cadence.smoothed_excess_s is None
    assert cadence.interval == 10
    intervals = _machine(
        cadence, range(12, 200), step_s=0.1, fed_s=0.003, stall_s=0.001, slowdown_s=0.009
    )
    assert max(intervals) == 10, intervals[:40]  # never above the start
    assert set(intervals[60:]) <= {5, 6}, intervals


def test_a_durable_save_counts_as_a_snapshot() -> None:
    # Durable saves every 25 steps also snapshot into memory: the interval counts from them
    # (no memory-only snapshot right after one), and neither their cost nor the slow step
    # after them (the write beside training) is taken for a memory snapshot's.
    cadence = AdaptiveCadence(smoothing=1.0, headroom=0.0)
    memory_only = []
    last = None
    for step in range(1, 200):
        slow = 0.05 if last == step - 1 else 0.0  # the step after a durable save
        cadence.observe_step(step, 0.1 + slow)
        if step % 25 == 0:
            cadence.observe_durable_save(step)
            last = step
        elif cadence.due(step):
            cadence.observe_snapshot(step, 0.01, 0.01)
            memory_only.append(step)
    assert cadence.interval == 5  # 10 ms of a 100 ms step
    assert cadence.smoothed_excess_s == pytest.approx(0.0)
    after = [s for s in memory_only if s > 100]
    # Five steps after each durable save, then every five: never the step right after one.
    assert all(s % 25 != 1 for s in after), after
    assert [s for s in after if 125 < s < 150] == [130, 135, 140, 145]


def _durable_every_5(
    cadence: AdaptiveCadence, steps: range, cost_s: float
) -> list[tuple[int, str]]:
    """The loop's calls with durable saves every 5 steps of 100 ms and memory snapshots
    costing `cost_s`: what each save was."""
    taken: list[tuple[int, str]] = []
    for step in steps:
        cadence.observe_step(step, 0.1)
        if step % 5 == 0:
            counts = cadence.counts_durable_save(step)
            cadence.observe_durable_save(step, counted=counts)
            taken.append((step, "durable, counted" if counts else "durable, kept here"))
        elif cadence.due(step):
            cadence.observe_snapshot(step, cost_s, 0.001)
            taken.append((step, "memory"))
    return taken


def test_with_peer_replicas_auto_snapshots_between_durable_saves_which_stay_on_their_node() -> None:
    # [Note: under `auto` a durable save between two snapshots stays on its node]: snapshots
    # costing 40 ms of a 100 ms step (interval 20 at 2%), durable saves every 5 steps. With
    # peer replicas no durable save is one of auto's snapshots: auto's own come every 20
    # steps (the one due at a durable step a step later), each measured. Without them every
    # durable save counts and auto's interval never comes due.
    replicas = AdaptiveCadence(smoothing=1.0, headroom=0.0, initial=20, durable_saves_count=False)
    taken = _durable_every_5(replicas, range(1, 101), 0.04)
    assert replicas.interval == 20
    assert [s for s, what in taken if what == "memory"] == [20 + 1, 41, 61, 81]
    assert {what for s, what in taken if s % 5 == 0} == {"durable, kept here"}
    alone = AdaptiveCadence(smoothing=1.0, headroom=0.0, initial=20)
    taken = _durable_every_5(alone, range(1, 101), 0.04)
    assert {what for _, what in taken} == {"durable, counted"}
    assert cadence_for(StepInterval(), peer_replicas=True).counts_durable_save(20) is False
    assert cadence_for(StepInterval(), peer_replicas=False).counts_durable_save(3) is True
    assert cadence_for(StepInterval(4), peer_replicas=True).counts_durable_save(3) is True


def test_with_peer_replicas_a_snapshot_due_at_a_durable_save_comes_a_step_later() -> None:
    # Snapshots costing 6 ms of a 100 ms step (interval 3 at 2%), durable saves every 5.
    cadence = AdaptiveCadence(smoothing=1.0, headroom=0.0, initial=3, durable_saves_count=False)
    cadence.observe_snapshot(0, 0.006, 0.001)
    taken = _durable_every_5(cadence, range(1, 17), 0.006)
    assert cadence.interval == 3
    assert taken == [
        (3, "memory"), (5, "durable, kept here"), (6, "memory"), (9, "memory"),
        (10, "durable, kept here"), (12, "memory"), (15, "durable, kept here"), (16, "memory"),
    ]  # fmt: skip


def test_with_peer_replicas_the_two_steps_after_a_snapshot_are_its_cost() -> None:
    # [Note: a replica spills into the step after next]: a snapshot fed as 3 ms whose replica
    # slows the step after it by 30 ms and the next by 30 ms more, on 100 ms steps. Counting
    # the first step alone, auto sees 31 ms (interval 18 at 1.8%) and spends 3.3%; counting
    # both, 61 ms (interval 34), 1.8%.
    def settled(after_steps: int) -> int:
        cadence = AdaptiveCadence(durable_saves_count=False, after_steps=after_steps)
        intervals = _machine(
            cadence, range(1, 3000), step_s=0.1, fed_s=0.003, stall_s=0.001, slowdown_s=0.03,
            second_slowdown_s=0.03,
        )  # fmt: skip
        return intervals[-1]

    first_alone, both = settled(1), settled(2)
    assert 17 <= first_alone <= 20, first_alone
    assert 33 <= both <= 40, both
    assert 0.06 / (both * 0.1) <= 0.02 < 0.06 / (first_alone * 0.1)
    replicas = cadence_for(StepInterval(), peer_replicas=True)
    assert isinstance(replicas, AdaptiveCadence)
    machine = dict(step_s=0.1, fed_s=0.003, stall_s=0.001, slowdown_s=0.03, second_slowdown_s=0.03)
    assert 33 <= _machine(replicas, range(1, 3000), **machine)[-1] <= 40
    with pytest.raises(ValueError, match="after_steps=0"):
        AdaptiveCadence(after_steps=0)


def test_at_interval_1_a_slower_step_for_another_reason_is_corrected() -> None:
    # Cheap snapshots: every step. Then every step gets 10 ms slower for a reason of its own
    # (a longer sequence): measured against the last clean average (there is no clean step at
    # interval 1), it looks like the snapshots' cost, the interval goes up, clean steps come
    # back, the average follows them and the interval comes back down to 1.
    cadence = AdaptiveCadence()
    before = _machine(
        cadence, range(1, 300), step_s=0.1, fed_s=0.0005, stall_s=0.0005, slowdown_s=0.0
    )
    assert before[-1] == 1
    after = _machine(
        cadence, range(300, 1300), step_s=0.11, fed_s=0.0005, stall_s=0.0005, slowdown_s=0.0
    )
    assert max(after) > 1  # it took the slower steps for the snapshots' cost at first
    assert after[-200:] == [1] * 200


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
