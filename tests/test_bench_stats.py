"""`bench/_stats.py`: the bootstrap interval covers what it should, and a verdict holds only
when the interval's bad end meets the target."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _stats


def test_the_median_interval_holds_the_median_and_narrows_with_more_values() -> None:
    rng = random.Random(1)
    few = [rng.gauss(10.0, 1.0) for _ in range(8)]
    many = [rng.gauss(10.0, 1.0) for _ in range(200)]
    s_few, s_many = _stats.summary(few), _stats.summary(many)
    assert s_few is not None
    assert s_many is not None
    for s, values in ((s_few, few), (s_many, many)):
        assert s["min"] <= s["ci95_lo"] <= s["median"] <= s["ci95_hi"] <= s["max"]
        assert s["median"] == statistics.median(values)
        assert s["n"] == len(values)
    assert s_many["ci95_hi"] - s_many["ci95_lo"] < (s_few["ci95_hi"] - s_few["ci95_lo"]) / 3
    assert s_many["ci95_lo"] < 10.0 < s_many["ci95_hi"]


def test_the_interval_covers_the_true_median_about_95_percent_of_the_time() -> None:
    rng = random.Random(2)
    covered = 0
    for trial in range(100):
        values = [rng.expovariate(1.0) for _ in range(31)]
        lo, hi = _stats.bootstrap_interval([values], statistics.median, resamples=200, seed=trial)
        covered += lo <= 0.6931 <= hi  # the median of Exp(1) is ln 2
    assert 85 <= covered <= 100  # 95% nominal; the percentile bootstrap runs a little low


def test_a_constant_sample_has_a_zero_width_interval_and_a_single_value_is_its_own() -> None:
    assert _stats.summary([3.0, 3.0, 3.0]) == {
        "median": 3.0,
        "ci95_lo": 3.0,
        "ci95_hi": 3.0,
        "min": 3.0,
        "max": 3.0,
        "n": 3,
    }
    one = _stats.summary([2.5])
    assert one is not None
    assert one["ci95_lo"] == one["ci95_hi"] == 2.5
    assert _stats.summary([]) is None


def test_ratio_and_quantile_summaries() -> None:
    r = _stats.ratio_summary([2.0, 2.2, 1.8, 2.1], [1.0, 1.1, 0.9, 1.0])
    assert r is not None
    assert r["median"] == pytest.approx(2.05 / 1.0)
    assert r["ci95_lo"] <= r["median"] <= r["ci95_hi"]
    assert r["min"] == pytest.approx(1.8 / 1.1)
    assert r["max"] == pytest.approx(2.2 / 0.9)
    assert _stats.ratio_summary([1.0], [0.0]) is None
    q = _stats.quantile_summary([float(i) for i in range(1, 1001)], 0.99, resamples=200)
    assert q is not None
    assert q["n"] == 1000
    assert q["value"] == pytest.approx(990.01)
    assert q["ci95_lo"] <= q["value"] <= q["ci95_hi"]
    assert _stats.quantile([1.0, 2.0, 3.0], 0.5) == 2.0


@pytest.mark.parametrize(
    ("lo", "hi", "op", "target", "expected"),
    [
        (1.0, 1.5, "<=", 2.0, "meets"),
        (1.5, 2.5, "<=", 2.0, "inconclusive"),  # the median may meet it; the bad end does not
        (2.1, 2.5, "<=", 2.0, "misses"),
        (1.0, 1.5, ">=", 0.9, "meets"),
        (0.8, 1.5, ">=", 0.9, "inconclusive"),
        (0.5, 0.8, ">=", 0.9, "misses"),
    ],
)
def test_a_verdict_is_judged_on_the_intervals_bad_end(
    lo: float, hi: float, op: str, target: float, expected: str
) -> None:
    spread = {"median": (lo + hi) / 2, "ci95_lo": lo, "ci95_hi": hi}
    assert _stats.verdict(spread, op, target) == expected


def test_a_key_whose_a_a_noise_reaches_a_quarter_of_its_target_is_unresolved() -> None:
    quiet = {"median": 0.0, "ci95_lo": -0.05, "ci95_hi": 0.04}
    loud = {"median": 0.0, "ci95_lo": -0.3, "ci95_hi": 0.2}
    assert _stats.resolved(quiet, 0.5) is None
    why = _stats.resolved(loud, 0.5)
    assert why is not None
    assert why.startswith("unresolved on this machine")
    assert _stats.resolved(None, 0.5) is not None
