"""Retention policies, their union, and the invariants of plan_deletions."""

from __future__ import annotations

import pytest

from ckpt_manager import AnyOf, KeepBest, KeepEvery, KeepInterval, KeepLast, MetricMode, StepInfo
from ckpt_manager._retention.base import plan_deletions


def _steps(*items: tuple[int, float, dict[str, float]]) -> list[StepInfo]:
    return [StepInfo(s, t, m) for s, t, m in items]


SIX = _steps(
    (100, 0.0, {"loss": 5.0}),
    (200, 10.0, {"loss": 1.0}),
    (300, 20.0, {"loss": 3.0}),
    (400, 65.0, {"loss": 2.0}),
    (500, 70.0, {}),
    (600, 130.0, {"loss": 9.0}),
)


def test_keep_last() -> None:
    assert KeepLast(n=2).keep(SIX) == {500, 600}
    assert plan_deletions(KeepLast(n=2), SIX) == [100, 200, 300, 400]


def test_keep_every() -> None:
    assert KeepEvery(every=200).keep(SIX) == {200, 400, 600}


def test_keep_interval_walks_commit_times() -> None:
    assert KeepInterval(interval_s=60.0).keep(SIX) == {100, 400, 600}


def test_keep_best_min_and_max_skip_missing_metric() -> None:
    assert KeepBest(metric="loss", n=2).keep(SIX) == {200, 400}
    assert KeepBest(metric="loss", n=1, mode=MetricMode.MAX).keep(SIX) == {600}
    assert KeepBest(metric="acc", n=3).keep(SIX) == set()


def test_best_n_never_deletes_the_newest_step() -> None:
    worse = [*SIX[:-1], StepInfo(700, 200.0, {"loss": 99.0})]
    doomed = plan_deletions(KeepBest(metric="loss", n=1), worse)
    assert 700 not in doomed
    assert doomed == [100, 300, 400, 500]


def test_union_and_protected_steps() -> None:
    policy = AnyOf(KeepLast(n=1), KeepEvery(every=300), KeepBest(metric="loss", n=1))
    assert policy.keep(SIX) == {600, 300, 200}
    assert plan_deletions(policy, SIX, protected={100}) == [400, 500]


def test_empty_history_deletes_nothing() -> None:
    assert plan_deletions(KeepLast(n=1), []) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLast(n=0),
        lambda: KeepEvery(every=0),
        lambda: KeepInterval(interval_s=0),
        lambda: KeepBest(metric="", n=1),
        lambda: KeepBest(metric="loss", n=0),
        lambda: KeepBest(metric="loss", mode="median"),
        AnyOf,
        lambda: AnyOf(object()),  # type: ignore[arg-type]
    ],
)
def test_invalid_policies_say_how_to_fix(make: object) -> None:
    with pytest.raises(ValueError, match=r"\S"):
        make()  # type: ignore[operator]
