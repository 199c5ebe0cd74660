"""Spreads and verdicts of the recovery bench (pure functions, no I/O).

Every key of the report is a `Figure`: the judged value, its spread over the samples it came
from (median, min, max, n and a bootstrap 95% interval of the median), the target and the
verdict. A figure that could not be measured carries `unavailable: <why>` instead of a value
and is never judged.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_OPS = ("<=", ">=", "==")


def spread(samples: Sequence[float], *, rounds: int = 1000, seed: int = 0) -> dict[str, Any]:
    """`{"n", "median", "min", "max", "median_ci95"}` of `samples` (empty: `{"n": 0}`).

    The interval is a percentile bootstrap of the median (`rounds` resamples, seeded).
    """
    data = [float(x) for x in samples]
    if not data:
        return {"n": 0}
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(data, k=len(data))) for _ in range(rounds))
    lo, hi = medians[int(0.025 * (rounds - 1))], medians[int(0.975 * (rounds - 1))]
    return {
        "n": len(data),
        "median": statistics.median(data),
        "min": min(data),
        "max": max(data),
        "median_ci95": [lo, hi],
    }


def bootstrap_ratio(
    numerator: Sequence[float], denominator: Sequence[float], *, rounds: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """The ratio of two medians and a bootstrap 95% interval of it (`{}` if either is empty)."""
    if not numerator or not denominator or statistics.median(denominator) == 0:
        return {}
    rng = random.Random(seed)
    ratios = []
    for _ in range(rounds):
        den = statistics.median(rng.choices(denominator, k=len(denominator)))
        if den > 0:
            ratios.append(statistics.median(rng.choices(numerator, k=len(numerator))) / den)
    ratios.sort()
    value = statistics.median(numerator) / statistics.median(denominator)
    if not ratios:
        return {"ratio": value}
    lo, hi = ratios[int(0.025 * (len(ratios) - 1))], ratios[int(0.975 * (len(ratios) - 1))]
    return {"ratio": value, "ratio_ci95": [lo, hi]}


def merge_histograms(histograms: Iterable[Mapping[str, float]]) -> dict[float, float]:
    """Prometheus histograms (`{le: cumulative count}`, bounds as their JSON strings or
    floats) added bucket by bucket, keyed by float bound."""
    merged: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram.items():
            merged[float(le)] = merged.get(float(le), 0.0) + count
    return merged


def percentile_from_histogram(buckets: Mapping[float, float], q: float) -> float | None:
    """The `q` quantile of a Prometheus histogram (`{le: cumulative count}`, `inf` included),
    interpolated linearly inside the bucket, as PromQL's `histogram_quantile` does; None
    without observations. A quantile in the `+Inf` bucket is the largest finite bound."""
    if not 0 < q < 1:
        raise ValueError("q must be in (0, 1)")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def judge(value: float | None, op: str, target: float) -> str:
    """`meets` / `MISSES`, or `n/a` for a value not measured."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    if value is None:
        return "n/a"
    ok = {"<=": value <= target, ">=": value >= target, "==": value == target}[op]
    return "meets" if ok else "MISSES"


def figure(
    value: float | str | None,
    op: str,
    target: float | None,
    *,
    samples: Sequence[float] = (),
    unit: str = "",
    how: str = "",
    judge_bad_end: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """One report key: value, target, verdict, spread of `samples` and how it was measured.

    A `str` value must start with `unavailable: ` (why it was not measured); a `None` target
    reports the value without judging it. With `judge_bad_end` (and at least 3 samples) the
    verdict is taken on the end of the median's bootstrap interval that is worse for the
    target (`judged_on`): a key meets only if its whole interval does, misses if none of it
    does, and is `unresolved` (the machine's noise cannot tell) when the target lies inside.
    """
    judged = value
    good_end: float | None = None
    if judge_bad_end and len(samples) >= 3 and target is not None:
        lo, hi = spread(samples)["median_ci95"]
        judged, good_end = (hi, lo) if op == "<=" else (lo, hi)
    if isinstance(value, str):
        if not value.startswith("unavailable: "):
            raise ValueError("a figure's text value must say `unavailable: <why>`")
        verdict = "unavailable"
    elif target is None:
        verdict = "no target"
    else:
        verdict = judge(None if isinstance(judged, str) else judged, op, target)
        if verdict == "MISSES" and good_end is not None and judge(good_end, op, target) == "meets":
            verdict = "unresolved"
    out: dict[str, Any] = {
        "value": value,
        "target": "none" if target is None else f"{op} {target:g}",
        "verdict": verdict,
        "unit": unit,
        "how": how,
    }
    if samples:
        out["spread"] = spread(samples)
    if judged is not value:
        out["judged_on"] = judged
    out.update(extra)
    return out


def verdict_table(keys: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """Rows `[key, value, median (min-max, n), target, verdict]` for a markdown table."""
    rows = []
    for name, fig in keys.items():
        value = fig["value"]
        shown = value if not isinstance(value, float) else round(value, 4)
        sp = fig.get("spread", {})
        if sp.get("n"):
            spread_text = f"{sp['median']:.4g} ({sp['min']:.4g}-{sp['max']:.4g}, n={sp['n']})"
        else:
            spread_text = ""
        rows.append([name, shown, spread_text, fig["target"], fig["verdict"]])
    return rows
