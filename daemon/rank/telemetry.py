"""Rank-side metric recording, published as the rank's snapshot file.

See [Note: one endpoint per node, ranks publish snapshots] in `daemon/metrics.py`. A rank records
into plain dicts (no Prometheus objects in the training processes) and publishes its cumulative
values as one snapshot file (`daemon/rundir/snapshot.py` holds its format), at most every
`publish_interval_s` and when forced (phase changes, exit). A phase entered for a call that is
usually quick (`in_phase`: a checkpoint call) is published only if it lasts (`phase_watch.py`).

The engines' observers (`sharding.CollectiveObserver`, `ckpt_manager.SaveObserver`) are methods
of `RankTelemetry`, so the engines never see Prometheus either. `NullTelemetry` has the same
recording and observer methods, doing nothing, for a loop that should record nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.metrics import spec
from daemon.rank.phase_watch import PhaseWatch
from daemon.rundir.progress import ProgressPhase, ProgressWord
from daemon.rundir.snapshot import SNAPSHOT_SCHEMA, RankPhase, write_snapshot

if TYPE_CHECKING:
    from ckpt_manager import ManagerStats, SaveReport
    from sharding import ShardingStatsSnapshot

__all__ = ["NullTelemetry", "RankTelemetry"]


@dataclasses.dataclass
class _Histogram:
    counts: list[int]
    total: float = 0.0


_PROGRESS_OF = {
    RankPhase.STARTING: ProgressPhase.STARTING,
    RankPhase.LOADING: ProgressPhase.LOADING,
    RankPhase.RESTORING: ProgressPhase.RESTORING,
    RankPhase.STOPPING: ProgressPhase.CHECKPOINT,
    RankPhase.FINISHING: ProgressPhase.CHECKPOINT,
    RankPhase.FINISHED: ProgressPhase.FINISHING,
    RankPhase.EXITED: ProgressPhase.EXITED,
}
"""The progress phase a beat in each rank phase marks (none in `training`: the loop marks)."""


class RankTelemetry:
    """Cumulative metrics of one rank process, published as a snapshot file.

    Thread-safe: the checkpoint manager reports saves from its own thread.

    Args:
        path: snapshot file (`daemon.rundir.snapshot.snapshot_path`); `None` records without
            publishing (read back with `snapshot()`; a rank with no reader at all uses
            `NullTelemetry`).
        rank: global rank.
        world_size: ranks in the job.
        restart: `TORCHELASTIC_RESTART_COUNT` of this incarnation.
        publish_interval_s: minimum time between two unforced publishes.
        clock: Unix time source (tests inject one).
        progress: the rank's progress word (`daemon.rundir.progress.progress_path`), marked
            by `mark` and by each phase change; None: not kept.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        rank: int,
        world_size: int,
        restart: int = 0,
        publish_interval_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        progress: Path | None = None,
    ) -> None:
        self._path = path
        self._progress = ProgressWord(progress) if progress is not None else None
        self._identity = {
            "schema": SNAPSHOT_SCHEMA,
            "pid": os.getpid(),
            "rank": rank,
            "world_size": world_size,
            "restart": restart,
        }
        self.restart = restart
        """This incarnation's restart count (`TORCHELASTIC_RESTART_COUNT` plus earlier rounds')."""
        self._interval_s = publish_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counters: dict[str, dict[str, float]] = {}
        self._gauges: dict[str, dict[str, float]] = {}
        self._histograms: dict[str, dict[str, _Histogram]] = {}
        self._phase = RankPhase.STARTING
        self._last_publish = float("-inf")
        # The watch's thread publishes too: one writer at a time (one temp file name).
        self._publish_lock = threading.Lock()
        self._watch = PhaseWatch(lambda: self.publish(force=True))
        self.started_unix_s = clock()
        """When this rank process started recording (for `trainingd_rank_recovery_seconds`)."""
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    # --- recording ---------------------------------------------------------------------------
    def inc(self, name: str, amount: float = 1.0, label: str = "") -> None:
        """Add `amount` to counter `name` (with optional label value)."""
        with self._lock:
            series = self._counters.setdefault(name, {})
            series[label] = series.get(label, 0.0) + amount

    def set_total(self, name: str, value: float, label: str = "") -> None:
        """Set counter `name` to a cumulative value an engine counted since the process started."""
        with self._lock:
            self._counters.setdefault(name, {})[label] = float(value)

    def set(self, name: str, value: float, label: str = "") -> None:
        """Set gauge `name`."""
        with self._lock:
            self._gauges.setdefault(name, {})[label] = float(value)

    def observe(self, name: str, value: float, label: str = "") -> None:
        """Record one observation in histogram `name`."""
        buckets = spec(name).buckets
        with self._lock:
            series = self._histograms.setdefault(name, {})
            hist = series.get(label)
            if hist is None:
                hist = series[label] = _Histogram(counts=[0] * (len(buckets) + 1))
            # bisect_left: a value equal to an edge belongs to that bucket (le is inclusive).
            hist.counts[bisect.bisect_left(buckets, value)] += 1
            hist.total += value

    def set_histogram(self, name: str, values: dict[float, int], label: str = "") -> None:
        """Set histogram `name` to cumulative observations an engine counted (value -> count)."""
        buckets = spec(name).buckets
        counts = [0] * (len(buckets) + 1)
        total = 0.0
        for value, num in values.items():
            counts[bisect.bisect_left(buckets, value)] += num
            total += value * num
        with self._lock:
            self._histograms.setdefault(name, {})[label] = _Histogram(counts=counts, total=total)

    def heartbeat(self, phase: RankPhase | None = None) -> None:
        """Mark the loop alive (and change phase); publishes at once when the phase changes."""
        changed = phase is not None and phase != self._phase
        if phase is not None:
            self._phase = phase
        # Outside the loop (start-up, restore, drain) a beat is progress; inside it the loop
        # marks its own phases ([Note: progress goes through a shared-memory word, not the
        # snapshot] in `daemon/rundir/progress.py`).
        marked = _PROGRESS_OF.get(self._phase)
        if marked is not None:
            self.mark(marked)
        self.set("trainingd_rank_heartbeat_timestamp_seconds", self._clock())
        self.publish(force=changed)

    def mark(self, phase: ProgressPhase, step: int | None = None) -> None:
        """Record in the progress word that the rank entered `phase` (at `step`)."""
        if self._progress is not None:
            self._progress.mark(phase, step)

    @contextlib.contextmanager
    def in_phase(self, phase: RankPhase) -> Iterator[None]:
        """Be in `phase` for the block; published only if the block lasts.

        See [Note: a blocked checkpoint call says checkpointing] in `phase_watch.py`. A block
        that raises leaves the rank in `phase` (where it failed).
        """
        previous = self._phase
        self._phase = phase
        self._watch.arm()
        try:
            yield
        except BaseException:
            self._watch.disarm()
            raise
        published = self._watch.disarm()
        self._phase = previous
        if published:
            self.publish(force=True)

    def close(self) -> None:
        """End the phase watch's thread (the snapshot file stays)."""
        self._watch.close()

    @property
    def phase(self) -> RankPhase:
        """The rank's current phase."""
        return self._phase

    # --- engine observers --------------------------------------------------------------------
    def on_collective(self, op: str, num_bytes: int, seconds: float) -> None:
        """`sharding.CollectiveObserver`: one completed collective and the time waited on it."""
        self.observe("trainingd_fsdp_collective_seconds", seconds, op)

    def on_save_finished(self, report: SaveReport) -> None:
        """`ckpt_manager.SaveObserver`: one save reached its final state."""
        result = str(getattr(report.result, "value", report.result))
        self.inc("trainingd_ckpt_saves_total", 1.0, result)
        self.observe("trainingd_ckpt_save_stall_seconds", report.stall_s)
        self.observe("trainingd_ckpt_staging_seconds", report.staging_s)
        self.observe("trainingd_ckpt_write_seconds", report.write_s)
        self.observe("trainingd_ckpt_finalize_seconds", report.finalize_s)
        if result == "committed":
            self.observe("trainingd_ckpt_save_latency_seconds", report.latency_s)
            self.inc("trainingd_ckpt_bytes_total", float(report.num_bytes))

    def update_sharding(self, stats: ShardingStatsSnapshot) -> None:
        """Copy a `sharding.ShardingStatsSnapshot` (cumulative since the engine was built)."""
        for queue, peak in stats.queue_depth_step_peak.items():
            self.set("trainingd_fsdp_queue_depth_step_peak", peak, queue)
        for queue, bound in stats.queue_bound.items():
            self.set("trainingd_fsdp_queue_bound", bound, queue)
        for queue, depths in stats.queue_depth_at_issue.items():
            at_issue = {float(depth): num for depth, num in depths.items()}
            self.set_histogram("trainingd_fsdp_queue_issue_depth", at_issue, queue)
        self.set_total("trainingd_fsdp_prefetch_hits_total", stats.prefetch_hits)
        self.set_total("trainingd_fsdp_prefetch_misses_total", stats.prefetch_misses)
        for op, totals in stats.collectives.items():
            self.set_total("trainingd_fsdp_collective_bytes_total", totals.num_bytes, op)
            self.set_total("trainingd_fsdp_collective_wait_seconds_total", totals.seconds, op)

    def update_checkpoints(self, stats: ManagerStats) -> None:
        """Copy a `ckpt_manager.ManagerStats`."""
        self.set("trainingd_ckpt_inflight", stats.inflight)
        if stats.last_committed_step is not None:
            self.set("trainingd_ckpt_last_committed_step", stats.last_committed_step)
        if stats.last_committed_unix_s is not None:
            self.set("trainingd_ckpt_last_committed_timestamp_seconds", stats.last_committed_unix_s)
        self.set_total(
            "trainingd_memory_snapshot_failures_total", stats.num_memory_snapshots_failed
        )
        if stats.newest_memory_step is not None:
            self.set("trainingd_memory_newest_step", stats.newest_memory_step)

    # --- publishing --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The current cumulative values, in the snapshot file format."""
        with self._lock:
            return {
                **self._identity,
                "phase": self._phase.value,
                "counters": {k: dict(v) for k, v in self._counters.items()},
                "gauges": {k: dict(v) for k, v in self._gauges.items()},
                "histograms": {
                    k: {lv: {"counts": list(h.counts), "sum": h.total} for lv, h in v.items()}
                    for k, v in self._histograms.items()
                },
            }

    def publish(self, *, force: bool = False) -> bool:
        """Write the snapshot file if forced or the publish interval has passed.

        Returns:
            Whether a file was written.
        """
        if self._path is None:
            return False
        now = time.monotonic()
        if not force and now - self._last_publish < self._interval_s:
            return False
        with self._publish_lock:
            self._last_publish = now
            write_snapshot(self._path, self.snapshot())
        return True


class NullTelemetry:
    """Records nothing: `RankTelemetry`'s recording, observer and publishing methods as no-ops.

    Lets the training loop call its telemetry unconditionally. As an engine observer it costs
    one empty method call per collective or finished save (~0.2 us more than no observer;
    the default GPT runs 14 collectives in an 80 ms step), nothing a step can measure.
    """

    def __init__(self) -> None:
        self.started_unix_s = time.time()
        """When this object was made (read only for `trainingd_rank_recovery_seconds`)."""
        self.restart = 0
        """No incarnation is tracked: 0."""

    def inc(self, name: str, amount: float = 1.0, label: str = "") -> None:
        """Do nothing (`RankTelemetry.inc` adds to a counter)."""

    def set_total(self, name: str, value: float, label: str = "") -> None:
        """Do nothing (`RankTelemetry.set_total` sets a counter to an engine's total)."""

    def set(self, name: str, value: float, label: str = "") -> None:
        """Do nothing (`RankTelemetry.set` sets a gauge)."""

    def observe(self, name: str, value: float, label: str = "") -> None:
        """Do nothing (`RankTelemetry.observe` records a histogram observation)."""

    def set_histogram(self, name: str, values: dict[float, int], label: str = "") -> None:
        """Do nothing (`RankTelemetry.set_histogram` sets a histogram to an engine's counts)."""

    def heartbeat(self, phase: RankPhase | None = None) -> None:
        """Do nothing (`RankTelemetry.heartbeat` marks the loop alive)."""

    def mark(self, phase: ProgressPhase, step: int | None = None) -> None:
        """Do nothing (`RankTelemetry.mark` updates the progress word)."""

    @contextlib.contextmanager
    def in_phase(self, phase: RankPhase) -> Iterator[None]:
        """A context that does nothing (`RankTelemetry.in_phase` enters a rank phase)."""
        yield

    def close(self) -> None:
        """Do nothing (`RankTelemetry.close` ends the phase watch)."""

    def on_collective(self, op: str, num_bytes: int, seconds: float) -> None:
        """`sharding.CollectiveObserver` that ignores the collective."""

    def on_save_finished(self, report: SaveReport) -> None:
        """`ckpt_manager.SaveObserver` that ignores the report."""

    def update_sharding(self, stats: ShardingStatsSnapshot) -> None:
        """Do nothing (`RankTelemetry.update_sharding` copies the engine's stats)."""

    def update_checkpoints(self, stats: ManagerStats) -> None:
        """Do nothing (`RankTelemetry.update_checkpoints` copies the manager's stats)."""

    def publish(self, *, force: bool = False) -> bool:
        """Write nothing.

        Returns:
            False, like a `RankTelemetry` without a snapshot path.
        """
        return False
