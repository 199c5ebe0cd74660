"""`KeepInterval`: one step per interval of commit time."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckpt_manager._retention.base import StepInfo
from ckpt_manager._retention.registry import Param, PolicySpec, register

__all__ = ["SPEC", "KeepInterval"]


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


SPEC = register(
    PolicySpec(
        kind="keep_interval",
        policy=KeepInterval,
        params=(
            Param(
                name="interval_s",
                value_type=float,
                # `ckptctl`'s flag predates the key, which follows the `*_s` naming of durations.
                flag="--keep-interval",
                key="keep_interval_s",
                metavar="SECONDS",
                help="keep one step per SECONDS of commit time",
            ),
        ),
        label=lambda p: f"interval-{p.interval_s:g}s",
    )
)
"""`KeepInterval` in the registry: `--keep-interval SECONDS`, `keep_interval_s = SECONDS`,
`interval-Ss`."""
