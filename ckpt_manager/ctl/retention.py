"""Retention as `ckptctl` sees it: the manager's policies, labelled for humans.

`list` shows *why* each step survives retention and `prune` applies it offline; both use
`_retention/policies.py`'s policies and `plan_deletions` (the same invariants as the manager: the
newest committed step and pinned steps are never deleted). `list` shows the run's own policy,
recorded in the root by the manager (`_retention/record.py`), unless retention flags override it;
`prune` applies only the policy its flags give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckpt_manager._retention.policies import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    MetricMode,
    RetentionPolicy,
    StepInfo,
    plan_deletions,
)
from ckpt_manager._retention.record import label_of

__all__ = ["LATEST_REASON", "PINNED", "RetentionFlags", "retained_by"]

PINNED = "pinned"
LATEST_REASON = "latest"


@dataclasses.dataclass(kw_only=True, frozen=True)
class RetentionFlags:
    """The retention options of `list` and `prune` (all optional)."""

    keep_last: int | None = None
    """Keep the newest N committed steps."""
    keep_every: int | None = None
    """Keep steps that are multiples of N."""
    keep_interval_s: float | None = None
    """Keep one step per interval of commit time (seconds)."""
    keep_best: int | None = None
    """Keep the best N steps by `metric`."""
    metric: str | None = None
    """Metric ranked by `keep_best`."""
    mode: MetricMode = MetricMode.MIN
    """Whether lower (`min`) or higher (`max`) metric values are better."""

    def __post_init__(self) -> None:
        if self.keep_best is not None and not self.metric:
            raise ValueError("--keep-best needs --metric NAME (e.g. --metric loss)")
        if self.metric and self.keep_best is None:
            raise ValueError("--metric is used only with --keep-best N")

    def labelled(self) -> list[tuple[str, RetentionPolicy]]:
        """Each configured policy with the label `list` prints (`last-3`, `best loss` ...).

        Raises:
            ValueError: a value the policy rejects (its message says how to fix it).
        """
        parts: list[RetentionPolicy] = []
        if self.keep_last is not None:
            parts.append(KeepLast(n=self.keep_last))
        if self.keep_every is not None:
            parts.append(KeepEvery(every=self.keep_every))
        if self.keep_interval_s is not None:
            parts.append(KeepInterval(interval_s=self.keep_interval_s))
        if self.keep_best is not None:
            assert self.metric is not None
            parts.append(KeepBest(metric=self.metric, n=self.keep_best, mode=self.mode))
        return [(label_of(p) or type(p).__name__, p) for p in parts]

    @property
    def given(self) -> bool:
        """Whether any retention flag was given (flags override the root's record)."""
        return any(
            v is not None
            for v in (self.keep_last, self.keep_every, self.keep_interval_s, self.keep_best)
        )

    def policy(self) -> RetentionPolicy | None:
        """The union of the configured policies, or None when no flag was given."""
        parts = [p for _, p in self.labelled()]
        return AnyOf(*parts) if parts else None


def retained_by(
    infos: Sequence[StepInfo], pinned: set[int], labelled: Sequence[tuple[str, RetentionPolicy]]
) -> dict[int, list[str]]:
    """Why retention keeps each committed step: `latest`, `pinned` and policy labels.

    Args:
        infos: the committed steps.
        pinned: pinned steps.
        labelled: the policy's parts with their labels (`RetentionFlags.labelled()`, or the
            run's record from `record.read_retention`); empty when unknown.

    Returns:
        Reasons per step. A step with an empty list would be deleted by retention with that
        policy (when one is known; without one only `latest` and `pinned` are known).
    """
    ordered = sorted(infos, key=lambda s: s.step)
    reasons: dict[int, list[str]] = {s.step: [] for s in ordered}
    if ordered:
        reasons[ordered[-1].step].append(LATEST_REASON)
    for label, policy in labelled:
        for step in sorted(policy.keep(ordered)):
            if step in reasons:
                reasons[step].append(label)
    for step in sorted(pinned):
        if step in reasons:
            reasons[step].append(PINNED)
    if labelled:
        union = AnyOf(*(p for _, p in labelled))
        # Cross-check with the manager's own planner: what it would delete has no reason.
        doomed = set(plan_deletions(union, ordered, protected=pinned))
        assert all(bool(reasons[s]) != (s in doomed) for s in reasons), "reason/plan mismatch"
    return reasons
