"""The unshard pipeline: per-unit all-gathers with prefetch in forward and backward order.

```
SHARDED --issue(demand | ahead)--> GATHERING --wait--> UNSHARDED --reshard--> SHARDED
```
`unshard(u)` samples unit u's state on entry (before issuing anything): SHARDED is a prefetch
*miss* (gathered on demand on the critical path); GATHERING or UNSHARDED with an unconsumed
issue from an earlier call (prefetch or param sync) is a *hit*; UNSHARDED with nothing new
since its last use (activation recompute, the root unit) is *resident* and not counted. Then
it prefetches the following units in the pass's order while the unsharded bytes counted from
u (u included) stay below the budget, and waits for u. Without prefetch only u is issued.
"""

from __future__ import annotations

import enum

from sharding._buffer import FlatBucket
from sharding._comm import PendingCollective
from sharding._stats import ShardingStats

__all__ = ["GatherState", "Phase", "UnitGather", "UnshardPipeline"]


class GatherState(enum.Enum):
    """Where a unit's unsharded weights are."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Phase(enum.Enum):
    """Which pass asks for a unit (decides the prefetch direction)."""

    FORWARD = "forward"
    BACKWARD = "backward"


class UnitGather:
    """Gather state of one unit's sharded buckets."""

    def __init__(self, index: int, buckets: list[FlatBucket]) -> None:
        self.index = index
        self.buckets = buckets
        self.nbytes = sum(b.nbytes_full for b in buckets)
        self.state = GatherState.SHARDED
        self.pending: list[PendingCollective] = []
        # Issued ahead of need by an earlier call and not consumed yet.
        self.ahead = False


class UnshardPipeline:
    """Issues, waits on and releases unit all-gathers (ZeRO-3 only)."""

    def __init__(
        self,
        units: list[UnitGather],
        stats: ShardingStats,
        *,
        prefetch: bool,
        budget_bytes: int,
        counted: set[int],
    ) -> None:
        """Create the pipeline.

        Args:
            units: every unit, indexed by unit index (the root unit last).
            stats: counters to update.
            prefetch: whether to issue later units ahead of need.
            budget_bytes: prefetch budget (unsharded bytes counted from the requested unit).
            counted: units whose unshards count as prefetch hits or misses.
        """
        self.units = units
        self._stats = stats
        self.prefetch_enabled = prefetch
        self.budget_bytes = budget_bytes
        self._counted = counted
        self.order: list[int] = sorted(counted)
        self._recording: list[int] | None = None

    # ---- forward order ----

    def start_recording(self) -> None:
        """Start noting the order in which units run forward."""
        self._recording = []

    def note_forward(self, index: int) -> None:
        """Unit `index` is running forward."""
        if self._recording is not None and index not in self._recording:
            self._recording.append(index)

    def stop_recording(self) -> None:
        """Use the recorded order for prefetching from now on."""
        if self._recording:
            self.order = self._recording
        self._recording = None

    # ---- the pipeline ----

    def _issue(self, unit: UnitGather, *, ahead: bool) -> None:
        unit.pending = [b.gather_params() for b in unit.buckets]
        unit.state = GatherState.GATHERING
        self._stats.gathered(unit.nbytes)
        unit.ahead = ahead
        self._stats.allgather_issued()

    def wait(self, index: int) -> None:
        """Block (stream-wait on CUDA) until unit `index` is unsharded."""
        unit = self.units[index]
        if unit.state is GatherState.GATHERING:
            for pending in unit.pending:
                pending.wait()
            unit.pending = []
            unit.state = GatherState.UNSHARDED
            for bucket in unit.buckets:
                bucket.gate.open = True
            self._stats.allgather_waited()

    def prefetch_from(self, position: int, phase: Phase, *, used_bytes: int) -> None:
        """Issue units after `position` in the pass order while the budget allows."""
        if not self.prefetch_enabled:
            return
        seq = self.order if phase is Phase.FORWARD else self.order[::-1]
        total = used_bytes
        for index in seq[position + 1 :]:
            if total >= self.budget_bytes:
                break
            unit = self.units[index]
            total += unit.nbytes
            if unit.state is GatherState.SHARDED:
                self._issue(unit, ahead=True)

    def issue_ahead(self, index: int) -> None:
        """Issue unit `index` now for a later use (counts as a hit when used)."""
        unit = self.units[index]
        if unit.state is GatherState.SHARDED:
            self._issue(unit, ahead=True)

    def unshard(self, index: int, phase: Phase) -> None:
        """Make unit `index` usable: count hit/miss, issue, prefetch, wait."""
        unit = self.units[index]
        counted = index in self._counted
        if unit.state is GatherState.SHARDED:
            if counted:
                self._stats.prefetch(hit=False)
            self._issue(unit, ahead=False)
        elif unit.ahead and counted:
            self._stats.prefetch(hit=True)
        unit.ahead = False
        if counted:
            seq = self.order if phase is Phase.FORWARD else self.order[::-1]
            if index in seq:
                self.prefetch_from(seq.index(index), phase, used_bytes=unit.nbytes)
        self.wait(index)

    def unshard_all(self) -> None:
        """Issue every sharded unit at once, then wait for all (not prefetch-counted)."""
        for unit in self.units:
            if unit.state is GatherState.SHARDED:
                self._issue(unit, ahead=False)
        for unit in self.units:
            self.wait(unit.index)

    def reshard(self, index: int) -> None:
        """Release unit `index`'s unsharded weights (waits first if still gathering)."""
        unit = self.units[index]
        if unit.state is GatherState.SHARDED:
            return
        self.wait(index)
        for bucket in unit.buckets:
            bucket.free_full()
        self._stats.gathered(-unit.nbytes)
        unit.state = GatherState.SHARDED
        unit.ahead = False

    def reshard_all(self) -> None:
        """Release every unit (end of backward, before loading weights)."""
        for unit in self.units:
            self.reshard(unit.index)
