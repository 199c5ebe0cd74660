"""`KeepEvery`: steps that are multiples of a period, kept forever."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckpt_manager._retention.base import StepInfo
from ckpt_manager._retention.registry import Param, PolicySpec, register

__all__ = ["SPEC", "KeepEvery"]


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


SPEC = register(
    PolicySpec(
        kind="keep_every",
        policy=KeepEvery,
        params=(
            Param(
                name="every",
                value_type=int,
                flag="--keep-every",
                key="keep_every",
                metavar="N",
                help="keep every step that is a multiple of N",
            ),
        ),
        label=lambda p: f"every-{p.every}",
    )
)
"""`KeepEvery` in the registry: `--keep-every N`, `keep_every = N`, `every-N`."""
