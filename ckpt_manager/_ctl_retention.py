"""Retention as `ckptctl` sees it: the manager's policies, labelled for humans.

`list` shows *why* each step survives retention and `prune` applies it offline; both use
`_retention.py`'s policies and `plan_deletions` (the same invariants as the manager: the
newest committed step and pinned steps are never deleted). The run's own policy lives in its
config, not in the root, so both commands take it as flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckpt_manager._retention import (
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
        out: list[tuple[str, RetentionPolicy]] = []
        if self.keep_last is not None:
            out.append((f"last-{self.keep_last}", KeepLast(n=self.keep_last)))
        if self.keep_every is not None:
            out.append((f"every-{self.keep_every}", KeepEvery(every=self.keep_every)))
        if self.keep_interval_s is not None:
            label = f"interval-{self.keep_interval_s:g}s"
            out.append((label, KeepInterval(interval_s=self.keep_interval_s)))
        if self.keep_best is not None:
            assert self.metric is not None
            n = self.keep_best
            label = f"best {self.metric}" if n == 1 else f"best-{n} {self.metric}"
            out.append((label, KeepBest(metric=self.metric, n=self.keep_best, mode=self.mode)))
        return out

    def policy(self) -> RetentionPolicy | None:
        """The union of the configured policies, or None when no flag was given."""
        parts = [p for _, p in self.labelled()]
        return AnyOf(*parts) if parts else None


def retained_by(
    infos: Sequence[StepInfo], pinned: set[int], flags: RetentionFlags
) -> dict[int, list[str]]:
    """Why retention keeps each committed step: `latest`, `pinned` and policy labels.

    A step with an empty list would be deleted by `prune` with the same flags (when flags
    are given; without flags only `latest` and `pinned` are known).
    """
    ordered = sorted(infos, key=lambda s: s.step)
    reasons: dict[int, list[str]] = {s.step: [] for s in ordered}
    if ordered:
        reasons[ordered[-1].step].append(LATEST_REASON)
    for label, policy in flags.labelled():
        for step in sorted(policy.keep(ordered)):
            if step in reasons:
                reasons[step].append(label)
    for step in sorted(pinned):
        if step in reasons:
            reasons[step].append(PINNED)
    union = flags.policy()
    if union is not None:
        # Cross-check with the manager's own planner: what it would delete has no reason.
        doomed = set(plan_deletions(union, ordered, protected=pinned))
        assert all(bool(reasons[s]) != (s in doomed) for s in reasons), "reason/plan mismatch"
    return reasons
