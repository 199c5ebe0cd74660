"""The retention seam: `RetentionPolicy`, the `StepInfo` it sees, `AnyOf` and `plan_deletions`.

A policy sees every committed step (oldest first) and returns the steps it keeps; `AnyOf`
keeps the union. `plan_deletions` adds the invariants no policy can override: the newest
committed step, the step restored from, pinned steps and in-flight steps are always kept.
The built-in policies live one per module in `policies/`, each declared once in the registry
(`registry.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["AnyOf", "RetentionPolicy", "StepInfo", "plan_deletions"]


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
