"""Plain counters the engine updates and the daemon reads: queue depths, prefetch, collectives.

`ShardingStats` is owned by one engine; every mutation and `snapshot()` takes one lock, so a
metrics thread may read while training runs. Counting is a few integer additions per unit and
per collective, far below 1% of a step.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, runtime_checkable

__all__ = [
    "CollectiveObserver",
    "CollectiveTotals",
    "ShardingStats",
    "ShardingStatsSnapshot",
]

COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclasses.dataclass(frozen=True)
class CollectiveTotals:
    """Totals of one collective kind since the engine was built."""

    count: int
    """Completed collectives."""
    num_bytes: int
    """Bytes of the full (unsharded) buffers they moved."""
    seconds: float
    """Host time spent waiting on them (on CUDA a stream wait, so close to 0)."""


@runtime_checkable
class CollectiveObserver(Protocol):
    """Receives one call per completed collective (e.g. the daemon's latency histogram)."""

    def on_collective(self, op: str, num_bytes: int, seconds: float) -> None:
        """Called after waiting on a collective.

        Args:
            op: `"all_gather"`, `"reduce_scatter"` or `"all_reduce"`.
            num_bytes: bytes of the full buffer.
            seconds: host time spent waiting for it.
        """


@dataclasses.dataclass(kw_only=True, frozen=True)
class ShardingStatsSnapshot:
    """Cumulative engine counters at one moment (see CONTRACTS.md)."""

    allgather_queue_depth: int
    """Unit all-gathers issued and not yet waited on."""
    allgather_queue_depth_peak: int
    """Highest `allgather_queue_depth` seen."""
    reduce_queue_depth: int
    """Gradient reductions issued and not yet waited on."""
    reduce_queue_depth_peak: int
    """Highest `reduce_queue_depth` seen."""
    prefetch_hits: int
    """Unit unshards whose gather an earlier call had already issued (prefetch)."""
    prefetch_misses: int
    """Unit unshards that had to issue their gather on demand."""
    collectives: dict[str, CollectiveTotals]
    """Totals keyed by `"all_gather"`, `"reduce_scatter"`, `"all_reduce"`."""


class ShardingStats:
    """Mutable counters behind `snapshot()`; the engine is the only writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ag_depth = 0
        self._ag_peak = 0
        self._rs_depth = 0
        self._rs_peak = 0
        self._hits = 0
        self._misses = 0
        self._totals = {op: [0, 0, 0.0] for op in COLLECTIVE_OPS}

    def allgather_issued(self) -> None:
        """One unit gather entered the queue."""
        with self._lock:
            self._ag_depth += 1
            self._ag_peak = max(self._ag_peak, self._ag_depth)

    def allgather_waited(self) -> None:
        """One unit gather left the queue."""
        with self._lock:
            self._ag_depth -= 1

    def reduce_issued(self) -> None:
        """One gradient reduction entered the queue."""
        with self._lock:
            self._rs_depth += 1
            self._rs_peak = max(self._rs_peak, self._rs_depth)

    def reduce_waited(self) -> None:
        """One gradient reduction left the queue."""
        with self._lock:
            self._rs_depth -= 1

    def prefetch(self, *, hit: bool) -> None:
        """Count one unit unshard as a prefetch hit or miss."""
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def collective(self, op: str, num_bytes: int, seconds: float) -> None:
        """Count one completed collective."""
        with self._lock:
            totals = self._totals[op]
            totals[0] += 1
            totals[1] += num_bytes
            totals[2] += seconds

    def snapshot(self) -> ShardingStatsSnapshot:
        """Return the current counters as an immutable record."""
        with self._lock:
            return ShardingStatsSnapshot(
                allgather_queue_depth=self._ag_depth,
                allgather_queue_depth_peak=self._ag_peak,
                reduce_queue_depth=self._rs_depth,
                reduce_queue_depth_peak=self._rs_peak,
                prefetch_hits=self._hits,
                prefetch_misses=self._misses,
                collectives={
                    op: CollectiveTotals(int(t[0]), int(t[1]), float(t[2]))
                    for op, t in self._totals.items()
                },
            )
