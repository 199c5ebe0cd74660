"""Honest statistics for the benches (#33): a median (or a quantile) with a bootstrap 95%
interval, and verdicts judged on the interval's bad end.

- `summary(values)`: `{"median", "ci95_lo", "ci95_hi", "min", "max", "n"}`, the interval a
  percentile bootstrap of the median (resampled with replacement, a fixed seed so a rerun of
  the same figures prints the same interval);
- `ratio_summary(num, den)`: the same for `median(num) / median(den)` when the two come from
  separate runs (each side resampled on its own), with the min-max bound over every pairing;
- `quantile_summary(values, q)`: a quantile (e.g. a p99 over >= 1000 calls) and its interval;
- `verdict(spread, op, target)`: `meets` only when the interval's bad end meets the target
  (`ci95_hi` for `<=`, `ci95_lo` for `>=`), `misses` when even its good end does not, else
  `inconclusive` (the interval straddles the target: more rounds, or a quieter machine);
- `noise_floor(a_a)` and `resolved(...)`: an A/A estimate (the same estimator run on two
  identical arms) bounds what a key can resolve; a key whose A/A interval reaches a quarter of
  its target is reported as unresolved on this machine instead of as a number.

A bootstrap interval of n values is only as good as n: with 1-3 values it is the values'
range, and the bench says how many rounds each key had (`n`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "bootstrap_interval",
    "noise_floor",
    "quantile",
    "quantile_summary",
    "ratio_summary",
    "resolved",
    "summary",
    "verdict",
]

BOOTSTRAP_RESAMPLES = 2000
"""Resamples per interval: the 2.5% and 97.5% points then rest on 50 resamples each."""

_SEED = 20261204


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (linear interpolation between order statistics)."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    data = sorted(values)
    pos = q * (len(data) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def bootstrap_interval(
    samples: Sequence[Sequence[float]],
    statistic: Callable[..., float],
    *,
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = _SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(*samples)`, each sample resampled on its
    own (with replacement, its own size).

    Raises:
        ValueError: an empty sample, or `confidence` outside (0, 1).
    """
    if not samples or any(len(s) == 0 for s in samples):
        raise ValueError("bootstrap of an empty sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        drawn = [rng.choices(s, k=len(s)) for s in samples]
        stats.append(statistic(*drawn))
    tail = (1.0 - confidence) / 2
    return quantile(stats, tail), quantile(stats, 1.0 - tail)


def summary(values: Sequence[float] | None) -> dict[str, Any] | None:
    """Median with its bootstrap 95% interval, min, max and n; None without values."""
    if not values:
        return None
    lo, hi = bootstrap_interval([values], statistics.median)
    return {
        "median": float(statistics.median(values)),
        "ci95_lo": lo,
        "ci95_hi": hi,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def quantile_summary(
    values: Sequence[float] | None, q: float, *, resamples: int = BOOTSTRAP_RESAMPLES
) -> dict[str, Any] | None:
    """The `q` quantile with its bootstrap 95% interval (`value`, `ci95_lo`, `ci95_hi`, `n`)."""
    if not values:
        return None
    lo, hi = bootstrap_interval([values], lambda v: quantile(v, q), resamples=resamples)
    return {"value": quantile(values, q), "ci95_lo": lo, "ci95_hi": hi, "n": len(values)}


def ratio_summary(
    num: Sequence[float] | None, den: Sequence[float] | None
) -> dict[str, Any] | None:
    """`median(num) / median(den)` of two unpaired samples, with a bootstrap 95% interval
    (each side resampled on its own) and the min-max bound over every pairing of rounds.

    None where a side is missing or `median(den)` is not positive; the interval is None
    where some resample's denominator median is not positive (noise swallowed the cost),
    and min/max are None where a denominator round is not positive.
    """
    if not num or not den or statistics.median(den) <= 0:
        return None

    def ratio(n: Sequence[float], d: Sequence[float]) -> float:
        m = statistics.median(d)
        return statistics.median(n) / m if m > 0 else math.nan

    lo, hi = bootstrap_interval([num, den], ratio)
    out: dict[str, Any] = {
        "median": ratio(num, den),
        "ci95_lo": None if math.isnan(lo) or math.isnan(hi) else lo,
        "ci95_hi": None if math.isnan(lo) or math.isnan(hi) else hi,
        "min": None,
        "max": None,
        "n": [len(num), len(den)],
    }
    if min(den) > 0:
        a, b = min(num) / max(den), max(num) / min(den)
        out.update(min=min(a, b), max=max(a, b))
    return out


def verdict(spread: dict[str, Any] | None, op: str, target: float) -> str:
    """`meets`, `misses` or `inconclusive` for a summary against `op target` (`<=`/`>=`);
    `n/a` without a summary.

    Judged on the 95% interval: `meets` only when its bad end meets the target, `misses`
    when even its good end does not, `inconclusive` when it straddles the target. A summary
    without an interval (a single exact figure) is judged on its median (or `value`).

    Raises:
        ValueError: an unknown `op`.
    """
    if op not in ("<=", ">="):
        raise ValueError(f"op must be '<=' or '>=', got {op!r}")
    if spread is None:
        return "n/a"
    centre = spread.get("median", spread.get("value"))
    lo, hi = spread.get("ci95_lo"), spread.get("ci95_hi")
    if lo is None or hi is None:
        lo = hi = centre
    if centre is None:
        return "n/a"
    good, bad = (lo, hi) if op == "<=" else (hi, lo)

    def ok(x: float) -> bool:
        return x <= target if op == "<=" else x >= target

    if ok(bad):
        return "meets"
    return "inconclusive" if ok(good) else "misses"


def noise_floor(a_a: dict[str, Any] | None) -> float | None:
    """How far from 0 an A/A estimate's 95% interval reaches (None without one)."""
    if a_a is None:
        return None
    lo = a_a.get("ci95_lo")
    hi = a_a.get("ci95_hi")
    if lo is None or hi is None:
        return None
    return max(abs(lo), abs(hi))


def resolved(a_a: dict[str, Any] | None, target: float) -> str | None:
    """None when the A/A noise floor is below a quarter of `target`; else why not."""
    floor = noise_floor(a_a)
    if floor is None:
        return "unresolved on this machine: no A/A estimate (too few rounds)"
    if floor >= abs(target) / 4:
        return (
            f"unresolved on this machine: the A/A noise floor {floor:.3g} (95% interval of the "
            f"same estimator on two save-free arms) is not below a quarter of the target "
            f"{target}"
        )
    return None
