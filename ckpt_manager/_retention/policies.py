"""Retention policies: small composable objects that choose which committed steps to keep.

A policy sees every committed step (oldest first) and returns the steps it keeps; `AnyOf`
keeps the union. `plan_deletions` adds the invariants no policy can override: the newest
committed step, the step restored from, pinned steps and in-flight steps are always kept.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "AnyOf",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepLast",
    "MetricMode",
    "RetentionPolicy",
    "StepInfo",
    "plan_deletions",
]


class StepInfo(NamedTuple):
    """A committed step as retention sees it."""

    step: int
    """Training step."""
    committed_unix_s: float
    """When the manifest was written."""
    metrics: Mapping[str, Any]
    """User metrics saved with the step."""


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses steps to keep among committed ones."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Return the steps to keep; `steps` are committed and sorted oldest first."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class KeepLast:
    """Keep the newest `n` committed steps."""

    n: int
    """How many of the newest steps to keep (at least 1)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepLast(n={self.n}): keep at least 1 step")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Keep the last `n` steps."""
        return {s.step for s in steps[-self.n :]}


@dataclasses.dataclass(kw_only=True, frozen=True)
class KeepEvery:
    """Keep steps that are multiples of `every` (e.g. one per 1000 steps, forever)."""

    every: int
    """Step period (at least 1)."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"KeepEvery(every={self.every}): use a period of 1 or more")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Keep steps with `step % every == 0`."""
        return {s.step for s in steps if s.step % self.every == 0}


@dataclasses.dataclass(kw_only=True, frozen=True)
class KeepInterval:
    """Keep one step per time interval: the first, then each `interval_s` after the last kept."""

    interval_s: float
    """Minimum commit-time distance between two kept steps, in seconds."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"KeepInterval(interval_s={self.interval_s}): use a positive interval")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Walk oldest first, keeping a step when the interval has passed since the last kept."""
        kept: set[int] = set()
        last: float | None = None
        for s in steps:
            if last is None or s.committed_unix_s - last >= self.interval_s:
                kept.add(s.step)
                last = s.committed_unix_s
        return kept


class MetricMode(enum.StrEnum):
    """Whether lower or higher metric values are better."""

    MIN = "min"
    """Lower is better (loss)."""
    MAX = "max"
    """Higher is better (accuracy)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class KeepBest:
    """Keep the best `n` steps by a user metric; steps without the metric are not ranked."""

    metric: str
    """Name of the metric passed to `save(metrics=...)`."""
    n: int = 1
    """How many best steps to keep."""
    mode: MetricMode = MetricMode.MIN
    """`min` (lower is better) or `max`."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepBest(n={self.n}): keep at least 1 step")
        if not self.metric:
            raise ValueError("KeepBest needs a metric name, e.g. KeepBest(metric='loss')")
        try:
            object.__setattr__(self, "mode", MetricMode(self.mode))
        except ValueError:
            raise ValueError(f"KeepBest(mode={self.mode!r}): use 'min' or 'max'") from None

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Rank steps having a finite numeric metric; ties favour the newer step."""
        ranked: list[tuple[float, int]] = []
        for s in steps:
            value = s.metrics.get(self.metric)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value):
                continue
            key = float(value) if self.mode is MetricMode.MIN else -float(value)
            ranked.append((key, -s.step))
        ranked.sort()
        return {-neg_step for _, neg_step in ranked[: self.n]}


@dataclasses.dataclass(frozen=True, init=False)
class AnyOf:
    """Union of policies: a step is kept when any policy keeps it."""

    policies: tuple[RetentionPolicy, ...]
    """The combined policies."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf needs at least one policy, e.g. AnyOf(KeepLast(n=3))")
        for p in policies:
            if not callable(getattr(p, "keep", None)):
                raise ValueError(f"AnyOf: {p!r} is not a RetentionPolicy (no keep(steps))")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Union of what each policy keeps."""
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept


def plan_deletions(
    policy: RetentionPolicy,
    committed: Sequence[StepInfo],
    *,
    protected: Collection[int] = (),
) -> list[int]:
    """Return the committed steps to delete, oldest first.

    Args:
        policy: the retention policy.
        committed: every committed step (any order).
        protected: steps never deleted (pinned, restored from, in flight).

    Returns:
        Steps the policy drops, minus the newest committed step and `protected`.
    """
    ordered = sorted(committed, key=lambda s: s.step)
    if not ordered:
        return []
    kept = set(policy.keep(ordered)) | set(protected) | {ordered[-1].step}
    return [s.step for s in ordered if s.step not in kept]
