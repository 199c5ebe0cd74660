"""Plain counters the engine updates and the daemon reads: queue depths, prefetch, collectives.

`ShardingStats` is owned by one engine; every mutation and `snapshot()` takes one lock, so a
metrics thread may read while training runs. Counting is a few integer additions per unit and
per collective, far below 1% of a step.

[Note: queue depth per step] A peak since the engine was built reaches the bound within the
first steps and then never moves, so it cannot show a queue that fills up later or drains
again. The engine therefore also keeps, per queue, the peak of the step in progress (reset by
`end_step()`, which the optimizer calls at each step boundary; `snapshot()` reports the peak of
the last completed step), the configured bound, and how often each depth was reached at an
issue (depth -> count, a histogram the daemon buckets).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, runtime_checkable

__all__ = [
    "QUEUES",
    "CollectiveObserver",
    "CollectiveTotals",
    "ShardingStats",
    "ShardingStatsSnapshot",
]

COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")
QUEUES = ("allgather", "reduce")
"""Names of the engine's two bounded queues (keys of the per-queue snapshot fields)."""


@dataclasses.dataclass(frozen=True)
class CollectiveTotals:
    """Totals of one collective kind since the engine was built."""

    count: int
    """Completed collectives."""
    num_bytes: int
    """Bytes of the full (unsharded) buffers they moved."""
    seconds: float
    """Time spent waiting on them: host time on CPU, the compute stream's stall on CUDA."""


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
    queue_depth_step_peak: dict[str, int]
    """Per queue (`QUEUES`): highest depth during the last completed step (see the Note)."""
    queue_bound: dict[str, int]
    """Per queue: the most entries it can hold (`max_inflight_reductions` for `reduce`; the
    number of ZeRO-3 units for `allgather`, whose prefetch budget is in bytes; 0: unused)."""
    queue_depth_at_issue: dict[str, dict[int, int]]
    """Per queue: depth right after an issue -> how many issues reached it."""
    prefetch_hits: int
    """Unit unshards whose gather an earlier call had already issued (prefetch)."""
    prefetch_misses: int
    """Unit unshards that had to issue their gather on demand."""
    collectives: dict[str, CollectiveTotals]
    """Totals keyed by `"all_gather"`, `"reduce_scatter"`, `"all_reduce"`."""
    gathered_bytes: int
    """Bytes of whole (gathered) unit weights allocated now (`OPTIM_GRADS_PARAMS`)."""
    gathered_bytes_peak: int
    """Highest `gathered_bytes` seen: the root unit plus the units in flight."""
    weight_gathers_pending: int = 0
    """`OPTIM` / `OPTIM_GRADS`: buckets whose post-step weight all-gather is issued and not
    yet waited on (it overlaps the next forward until the bucket's unit runs)."""
    weight_gathers_waited_in_forward: int = 0
    """Post-step weight all-gathers waited on by their own unit's pre-forward."""
    weight_gathers_waited_elsewhere: int = 0
    """Post-step weight all-gathers waited on by another reader (a parameter read, a state
    dict, `summon_full_params`, the next `step`, backward)."""


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
        self._bound = dict.fromkeys(QUEUES, 0)
        self._step_peak = dict.fromkeys(QUEUES, 0)
        self._last_step_peak = dict.fromkeys(QUEUES, 0)
        self._at_issue: dict[str, dict[int, int]] = {q: {} for q in QUEUES}
        self._gathered = 0
        self._gathered_peak = 0
        self._weights_pending = 0
        self._weights_in_forward = 0
        self._weights_elsewhere = 0

    def set_bound(self, queue: str, bound: int) -> None:
        """Record the configured capacity of `queue` (one of `QUEUES`)."""
        if queue not in self._bound:
            raise ValueError(f"queue={queue!r}: use one of {QUEUES}")
        with self._lock:
            self._bound[queue] = bound

    def _issued(self, queue: str, depth: int) -> None:
        # Caller holds the lock.
        self._step_peak[queue] = max(self._step_peak[queue], depth)
        seen = self._at_issue[queue]
        seen[depth] = seen.get(depth, 0) + 1

    def end_step(self) -> None:
        """A step ended: its per-queue peaks become the reported ones, the next step's start
        at the depth the queues hold now (work still in flight counts for the next step)."""
        with self._lock:
            self._last_step_peak = dict(self._step_peak)
            self._step_peak = {"allgather": self._ag_depth, "reduce": self._rs_depth}

    def allgather_issued(self) -> None:
        """One unit gather entered the queue."""
        with self._lock:
            self._ag_depth += 1
            self._ag_peak = max(self._ag_peak, self._ag_depth)
            self._issued("allgather", self._ag_depth)

    def allgather_waited(self) -> None:
        """One unit gather left the queue."""
        with self._lock:
            self._ag_depth -= 1

    def reduce_issued(self) -> None:
        """One gradient reduction entered the queue."""
        with self._lock:
            self._rs_depth += 1
            self._rs_peak = max(self._rs_peak, self._rs_depth)
            self._issued("reduce", self._rs_depth)

    def reduce_waited(self) -> None:
        """One gradient reduction left the queue."""
        with self._lock:
            self._rs_depth -= 1

    def gathered(self, num_bytes: int) -> None:
        """Whole unit weights were allocated (`num_bytes` > 0) or released (< 0)."""
        with self._lock:
            self._gathered += num_bytes
            self._gathered_peak = max(self._gathered_peak, self._gathered)

    def weight_gather_issued(self) -> None:
        """One bucket's post-step weight all-gather was issued and left pending."""
        with self._lock:
            self._weights_pending += 1

    def weight_gather_waited(self, *, in_forward: bool) -> None:
        """One pending weight all-gather was waited on (by its unit's pre-forward or not)."""
        with self._lock:
            self._weights_pending -= 1
            if in_forward:
                self._weights_in_forward += 1
            else:
                self._weights_elsewhere += 1

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
                queue_depth_step_peak=dict(self._last_step_peak),
                queue_bound=dict(self._bound),
                queue_depth_at_issue={q: dict(d) for q, d in self._at_issue.items()},
                collectives={
                    op: CollectiveTotals(int(t[0]), int(t[1]), float(t[2]))
                    for op, t in self._totals.items()
                },
                gathered_bytes=self._gathered,
                gathered_bytes_peak=self._gathered_peak,
                weight_gathers_pending=self._weights_pending,
                weight_gathers_waited_in_forward=self._weights_in_forward,
                weight_gathers_waited_elsewhere=self._weights_elsewhere,
            )
