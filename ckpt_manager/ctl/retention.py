"""Retention as `ckptctl` sees it: the manager's policies, labelled for humans.

`list` shows *why* each step survives retention and `prune` applies it offline; both use the
registered policies (`_retention/registry.py`: one flag per parameter, a label per policy) and
`plan_deletions` (the same invariants as the manager: the newest committed step and pinned
steps are never deleted). `list` shows the run's own policy, recorded in the root by the
manager (`_retention/record.py`), unless retention flags override it; `prune` applies only the
policy its flags give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ckpt_manager._retention.base import AnyOf, RetentionPolicy, StepInfo, plan_deletions
from ckpt_manager._retention.options import policies_from_flags
from ckpt_manager._retention.registry import label_of

__all__ = ["LATEST_REASON", "PINNED", "RetentionFlags", "retained_by"]

PINNED = "pinned"
LATEST_REASON = "latest"


@dataclasses.dataclass(frozen=True, init=False)
class RetentionFlags:
    """The retention options of `list` and `prune` (all optional), checked when built.

    `RetentionFlags(keep_last=3, keep_best=1, keep_best_metric="loss")`: one keyword per
    registered parameter, named by its configuration key (`ckptctl`'s `--metric` is
    `keep_best_metric`); None means not given.
    """

    parts: tuple[RetentionPolicy, ...]
    """The policies the flags turn on, in registry order."""

    def __init__(self, **given: Any) -> None:
        """Build the policies the flags give.

        Raises:
            ValueError: an unknown key, an option without its policy's flag, a missing
                required option, or a value the policy rejects (the message says how to fix
                it).
        """
        object.__setattr__(self, "parts", tuple(policies_from_flags(given)))

    def labelled(self) -> list[tuple[str, RetentionPolicy]]:
        """Each configured policy with the label `list` prints (`last-3`, `best loss` ...)."""
        return [(label_of(p) or type(p).__name__, p) for p in self.parts]

    @property
    def given(self) -> bool:
        """Whether any retention flag was given (flags override the root's record)."""
        return bool(self.parts)

    def policy(self) -> RetentionPolicy | None:
        """The union of the configured policies, or None when no flag was given."""
        return AnyOf(*self.parts) if self.parts else None


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
