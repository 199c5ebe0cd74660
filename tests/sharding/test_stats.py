"""Prefetch hits/misses, queue bounds, collective accounting, ZeRO-3 resident memory (2 ranks)."""

from __future__ import annotations

from typing import Any

import pytest

from sharding import ShardingStats
from tests.sharding._stats_ranks import delta, stats_and_memory
from tests.support.dist import run_on_ranks


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(stats_and_memory, 2, timeout_s=180)


@pytest.mark.slow
def test_prefetch_on_every_unit_hits_in_steady_state(results: list[dict[str, Any]]) -> None:
    for rank in results:
        run = rank["prefetch"][True]
        hits, misses = delta(run["after"], run["before"])
        # Forward and backward each unshard every unit once; all were issued ahead.
        assert (hits, misses) == (2 * run["units"], 0)
        assert run["after"].allgather_queue_depth_peak <= 2
        assert run["after"].allgather_queue_depth == 0


@pytest.mark.slow
def test_prefetch_off_every_unit_misses(results: list[dict[str, Any]]) -> None:
    for rank in results:
        run = rank["prefetch"][False]
        hits, misses = delta(run["after"], run["before"])
        assert (hits, misses) == (0, 2 * run["units"])
        assert run["after"].allgather_queue_depth_peak == 1


@pytest.mark.slow
def test_reduce_queue_never_exceeds_its_bound(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank["reduce_peak"] == {1: 1, 2: 2, 3: 3}


@pytest.mark.slow
def test_queue_depth_per_step_bound_and_depths_at_issue(results: list[dict[str, Any]]) -> None:
    for rank in results:
        for bound, (step_peak, reported_bound, at_issue) in rank["reduce_step"].items():
            # The model has more buckets than 3, so every step fills the queue to its bound.
            assert reported_bound == bound
            assert step_peak == bound
            assert max(at_issue) == bound
            assert min(at_issue) == 1
        # Every issue is counted once per depth: 2 steps of the same model, whatever the bound.
        totals = {sum(d.values()) for _, _, d in rank["reduce_step"].values()}
        assert len(totals) == 1
    run = results[0]["prefetch"][True]
    # end_step() moved the last step's peak into the snapshot; the bound counts every gather
    # unit: the wrapped blocks plus the root.
    after = run["after"]
    assert after.queue_depth_step_peak["allgather"] == after.allgather_queue_depth_peak
    assert after.queue_bound["allgather"] == run["units"] + 1


@pytest.mark.slow
def test_collectives_are_counted_and_observed(results: list[dict[str, Any]]) -> None:
    run = results[0]["prefetch"][True]
    snap = run["after"]
    totals = snap.collectives
    assert set(totals) == {"all_gather", "reduce_scatter", "all_reduce"}
    # 3 steps; per step: units + root gathered in forward, units again in backward; one
    # reduce-scatter per bucket.
    assert totals["all_gather"].count == 3 * (2 * run["units"] + 1)
    assert totals["reduce_scatter"].count > 0
    assert totals["all_gather"].num_bytes > 0
    for op, total in totals.items():
        # Measured waits: positive, within the run's wall time, and what the observer saw.
        if total.count:
            assert 0.0 < total.seconds < run["wall_s"], (op, total.seconds, run["wall_s"])
        assert abs(run["observer_seconds"][op] - total.seconds) <= 1e-9 * max(1.0, total.seconds)
    assert snap.reduce_queue_depth == 0
    count = sum(t.count for t in totals.values())
    assert run["observer_calls"] == count


@pytest.mark.slow
def test_zero3_memory_between_steps_is_a_shard(results: list[dict[str, Any]]) -> None:
    for rank in results:
        # Measured live tensor memory after backward (weights, grads, both Adam moments):
        # half of NO_SHARD's at two ranks, give or take buffers and scalars (5%). The
        # units in flight during a step are measured in test_memory.py.
        zero3, noshard = rank["zero3_bytes"], rank["noshard_bytes"]
        assert abs(2 * zero3 - noshard) <= 0.05 * noshard, (zero3, noshard)


def test_step_peak_is_the_last_completed_steps_and_starts_at_the_depth_in_flight() -> None:
    stats = ShardingStats()
    stats.set_bound("reduce", 3)
    for _ in range(3):
        stats.reduce_issued()
    for _ in range(2):
        stats.reduce_waited()
    assert stats.snapshot().queue_depth_step_peak["reduce"] == 0  # no step ended yet
    stats.end_step()
    snap = stats.snapshot()
    assert snap.queue_depth_step_peak == {"allgather": 0, "reduce": 3}
    assert snap.queue_bound == {"allgather": 0, "reduce": 3}
    assert snap.queue_depth_at_issue["reduce"] == {1: 1, 2: 1, 3: 1}
    # One reduction is still in flight when the next step starts: it counts for that step.
    stats.reduce_waited()
    stats.end_step()
    assert stats.snapshot().queue_depth_step_peak["reduce"] == 1
    stats.end_step()
    assert stats.snapshot().queue_depth_step_peak["reduce"] == 0
    assert stats.snapshot().reduce_queue_depth_peak == 3  # the since-start peak is kept
    with pytest.raises(ValueError, match="use one of"):
        stats.set_bound("scatter", 1)
