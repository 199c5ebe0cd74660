"""The agent's side of incidents: rank failures declared, restarts seen through to a step.

`IncidentWatch` is fed by the supervisor's tick (`observe`, with the same rank views `/metrics`
uses) and by the failure tracker (`rank_failures`, on the agent's thread). It adds to the
node's `IncidentLog` (`daemon/observe/incidents.py`) what only the agent side can see:

* when a rank died: the first tick that found its process gone (ticks are 0.25 s apart), or
  the mtime of the error file it wrote, whichever is earlier: the fault time of a failure;
* the step reached before a fault: the highest step of the local ranks' progress words
  (`daemon/rundir/progress.py`, current to the mark, where snapshots lag up to
  `publish_interval_s`), or a failure's own step;
* the end of a restart: every local rank of a new incarnation (pids not among those the
  watch knew when the incident opened) has completed its first step, i.e. exports
  `trainingd_rank_recovery_seconds`. The recovery time is then the newest heartbeat among
  them (a snapshot is published at least at each phase change, so this is the first step or
  shortly after); the restored step is the rank's step less the steps its incarnation did
  (`trainingd_train_steps_total` over the previous incarnation's last value), and the source
  is the label of `trainingd_rank_restart_recovery_seconds` whose count grew (none: nothing
  was restored, the group started from step 0).

[Note: counters of one incarnation] The views' counters are folded across incarnations by the
aggregator (`SnapshotAggregator`): a new pid's counters are its own plus every earlier one's
last values. The watch keeps each local rank's last view of the previous pid, so the
difference is the new incarnation's own count. The supervisor reads every tick and a dead
rank's file stays until its successor publishes, seconds later, so that last view is the
one the aggregator folded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from daemon._lifecycle import pid_alive
from daemon.observe.collector import RankView
from daemon.observe.incidents import IncidentKind, IncidentLog
from daemon.rundir.failure import error_path
from daemon.rundir.progress import progress_path, read_progress

if TYPE_CHECKING:
    from daemon.agent.failures import RankFailure, Verdict

__all__ = ["IncidentWatch"]

_RECOVERY = "trainingd_rank_recovery_seconds"
_RESTART_RECOVERY = "trainingd_rank_restart_recovery_seconds"
_STEPS = "trainingd_train_steps_total"
_HEARTBEAT = "trainingd_rank_heartbeat_timestamp_seconds"


class IncidentWatch:
    """Feeds rank failures and restarts into the node's incident log; thread-safe.

    Args:
        incidents: the node's incident log.
        run_dir: the per-run directory (progress words, error files).
        local_ranks: rank processes on this node.
        clock: Unix time source.
        alive: whether a pid is alive (tests inject one).
    """

    def __init__(
        self,
        incidents: IncidentLog,
        run_dir: Path,
        *,
        local_ranks: int,
        clock: Callable[[], float] = time.time,
        alive: Callable[[int], bool] = pid_alive,
    ) -> None:
        self.incidents = incidents
        """The log this watch writes to."""
        self._run_dir = run_dir
        self._local_ranks = local_ranks
        self._clock = clock
        self._alive = alive
        self._lock = threading.Lock()
        self._current: dict[int, RankView] = {}
        self._previous: dict[int, RankView] = {}
        self._dead_at: dict[int, float] = {}
        # Incident id -> the pids that were running when it opened (not a restart's).
        self._old_pids: dict[int, set[int]] = {}

    def observe(self, views: list[RankView]) -> None:
        """Take in one supervisor tick: deaths, incarnations, and the end of restarts."""
        now = self._clock()
        with self._lock:
            # Pids known before this tick's views: an incident opened since the last tick (by
            # the failure tracker, or the hang detector earlier in this tick) began under them.
            known = {v.pid for v in self._current.values()}
            for incident in self.incidents.awaiting_restart():
                self._old_pids.setdefault(incident.id, known)
            for view in views:
                seen = self._current.get(view.local_rank)
                if seen is not None and seen.pid != view.pid:
                    self._previous[view.local_rank] = seen
                self._current[view.local_rank] = view
                if view.pid not in self._dead_at and not self._alive(view.pid):
                    self._dead_at[view.pid] = now
            awaiting = self.incidents.awaiting_restart()
            if not awaiting:
                return
            old = set().union(*(self._old_pids.get(i.id, known) for i in awaiting))
            ended = self._restart_ended(views, old)
        if ended is not None:
            unix_s, restored_step, source = ended
            for closed in self.incidents.restarted(
                unix_s=unix_s, restored_step=restored_step, source=source
            ):
                self._old_pids.pop(closed.id, None)

    def _restart_ended(
        self, views: list[RankView], old: set[int]
    ) -> tuple[float, int | None, str | None] | None:
        """(when, restored step, source) once a new incarnation stepped; else None."""
        if not views or len(views) < self._local_ranks:
            return None
        newest = max(v.restart for v in views)
        group = [v for v in views if v.restart == newest]
        if len(group) < self._local_ranks:
            return None
        if any(v.pid in old or v.gauge(_RECOVERY) is None for v in group):
            return None
        beats = [b for v in group if (b := v.gauge(_HEARTBEAT)) is not None]
        unix_s = min(max(beats), self._clock()) if beats else self._clock()
        steps = [s for v in group if (s := self._restored_step(v)) is not None]
        sources = [src for v in group if (src := self._source(v)) is not None]
        restored = min(steps) if steps else None
        source = max(set(sources), key=sources.count) if sources else None
        if source is None and restored is not None and restored > 0:
            restored = None  # a restore whose source is unknown: do not guess the steps
        return unix_s, restored, source

    def _restored_step(self, view: RankView) -> int | None:
        """The step `view`'s incarnation started from ([Note: counters of one incarnation])."""
        step = view.gauge("trainingd_train_step")
        if step is None:
            return None
        before = self._previous.get(view.local_rank)
        base = 0.0 if before is None else before.counters.get(_STEPS, {}).get("", 0.0)
        done = view.counters.get(_STEPS, {}).get("", 0.0) - base
        restored = round(step - done)
        return restored if restored >= 0 else None

    def _source(self, view: RankView) -> str | None:
        """The label of the restart-recovery histogram that `view`'s incarnation observed."""
        before = self._previous.get(view.local_rank)
        old = {} if before is None else before.histograms.get(_RESTART_RECOVERY, {})
        for label, (counts, _) in view.histograms.get(_RESTART_RECOVERY, {}).items():
            previous = sum(old[label][0]) if label in old else 0
            if sum(counts) > previous:
                return label
        return None

    def rank_failures(self, failures: list[RankFailure], verdict: Verdict) -> None:
        """Declare the failures of one attempt as one incident (the agent's thread).

        Failures of ranks the hang detector killed belong to the hang's incident (its open
        one); a verdict that ends the run makes the incident fatal at once.
        """
        from daemon.agent.failures import FailureReason, Verdict, lost_a_peer

        # The hang detector SIGKILLs every local rank of a hang: its cause fails as `hung`, the
        # others as killed by SIGKILL; all of them are the hang's story, not a new one.
        hang_kill = any(f.reason is FailureReason.HUNG for f in failures) or (
            self.incidents.is_open(IncidentKind.HANG)
            and all(f.signal == "SIGKILL" for f in failures)
        )
        own = [] if hang_kill else failures
        if verdict is Verdict.RETRY and not own:
            return
        shown = own or failures
        first = min(shown, key=lambda f: _PRIORITY.get(f.reason.value, len(_PRIORITY)))
        others = len(shown) - 1
        cause = first.describe() + (f" (and {others} more)" if others else "")
        kind = IncidentKind.RANK_FAILURE
        if verdict is Verdict.DETERMINISTIC:
            kind = IncidentKind.DETERMINISTIC
        elif all(lost_a_peer(f.error) for f in shown):
            # The fault is elsewhere (another node); [Note: a rank that lost its peer is not the
            # failure] in failures.py already named a local cause where one exists.
            kind = IncidentKind.PEER_LOST
        incident = self.incidents.open(
            kind,
            ranks=[f.rank for f in shown],
            cause=cause,
            fault_unix_s=self._fault_time(shown),
            step_before=self._step_reached([f.step for f in shown]),
        )
        if verdict is not Verdict.RETRY:
            self.incidents.fatal(incident.id)

    def _fault_time(self, failures: list[RankFailure]) -> float | None:
        """When the first of these ranks died, as far as this node saw it."""
        now = self._clock()
        times = []
        with self._lock:
            for f in failures:
                view = self._current.get(f.local_rank)
                if view is not None:
                    if view.pid not in self._dead_at and not self._alive(view.pid):
                        self._dead_at[view.pid] = now
                    if view.pid in self._dead_at:
                        times.append(self._dead_at[view.pid])
                if f.error is not None:  # written by this attempt's rank as it failed
                    with contextlib.suppress(OSError):
                        times.append(error_path(self._run_dir, f.local_rank).stat().st_mtime)
        return min(times) if times else None

    def _step_reached(self, failure_steps: list[int | None]) -> int | None:
        """The highest step the local ranks' progress words (or the failures) show."""
        steps = [s for s in failure_steps if s is not None]
        for local in range(self._local_ranks):
            reading = read_progress(progress_path(self._run_dir, local))
            if reading is not None:
                steps.append(reading.step)
        return max(steps) if steps else None


_PRIORITY = {"oom": 0, "signal": 1, "exception": 2, "config": 3, "exit_code": 4, "hung": 5}
"""Which failure of an attempt names it: a killed or out-of-memory rank explains its peers'
errors (a peer of a killed rank fails in its next collective), not the other way round."""
