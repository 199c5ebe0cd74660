"""`KeepLast`: the newest N committed steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckpt_manager._retention.base import StepInfo
from ckpt_manager._retention.registry import Param, PolicySpec, register

__all__ = ["SPEC", "KeepLast"]


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


SPEC = register(
    PolicySpec(
        kind="keep_last",
        policy=KeepLast,
        params=(
            Param(
                name="n",
                value_type=int,
                flag="--keep-last",
                key="keep_last",
                metavar="N",
                help="keep the newest N committed steps",
            ),
        ),
        label=lambda p: f"last-{p.n}",
        # trainingd keeps its newest 3 by default; keep_last = 0 there has always meant
        # "keep every checkpoint" ([Note: keep_last = 0 keeps all] in `options.py`).
        config_default=3,
        zero_keeps_all=True,
    )
)
"""`KeepLast` in the registry: `--keep-last N`, `keep_last = N`, `last-N`."""
