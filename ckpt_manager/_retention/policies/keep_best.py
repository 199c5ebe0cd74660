"""`KeepBest`: the best N steps by a metric saved with them (`MetricMode` says which way)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from ckpt_manager._retention.base import StepInfo
from ckpt_manager._retention.registry import Param, PolicySpec, register

__all__ = ["SPEC", "KeepBest", "MetricMode"]


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


def _label(policy: KeepBest) -> str:
    best = "best" if policy.n == 1 else f"best-{policy.n}"
    return f"{best} {policy.metric}"


SPEC = register(
    PolicySpec(
        kind="keep_best",
        policy=KeepBest,
        params=(
            Param(
                name="n",
                value_type=int,
                flag="--keep-best",
                key="keep_best",
                metavar="N",
                help="keep the best N steps by a metric saved with them",
            ),
            Param(
                name="metric",
                value_type=str,
                flag="--metric",
                key="keep_best_metric",
                metavar="NAME",
                help="the metric ranked, e.g. loss",
            ),
            Param(
                name="mode",
                value_type=MetricMode,
                flag="--mode",
                key="keep_best_mode",
                metavar="min|max",
                help="whether lower or higher values of the metric are better: min or max",
                default=MetricMode.MIN,
            ),
        ),
        label=_label,
    )
)
"""`KeepBest` in the registry: `--keep-best N --metric NAME [--mode min|max]`,
`keep_best = N` with `keep_best_metric` and `keep_best_mode`, `best NAME` / `best-N NAME`."""
