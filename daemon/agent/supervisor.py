"""The daemon's supervisor thread: watches the ranks, drives health, sd_notify and progress.

One thread, owned by `Supervisor`, wakes every `_TICK_S`. Each iteration:

1. reads the local ranks' snapshots (the same aggregator `/metrics` uses);
2. derives the node phase and readiness, world size, restarts, step (`NodeState.update`, which is
   also the supervisor heartbeat behind `/healthz`); logs `membership_changed` when the world
   size changes (an elastic job that shrank or grew);
3. kills the process group of every rank that is no longer alive (orphaned checkpoint writers,
   see [Note: how rank processes and their checkpoint writers die with the daemon]);
4. talks to systemd: `READY=1` once every local rank has restored and trains, `STATUS=` with
   step and loss, `WATCHDOG=1` only while the node is healthy (so a hung training loop is
   caught), `EXTEND_TIMEOUT_USEC=` while starting and while draining, but only after the node
   moved (`TimeoutExtender`: a hung restore must let systemd's start timeout fire);
5. feeds the hang detector (`hang.py`), which restarts a group whose rank stopped progressing,
   the straggler watch (`straggler.py`), which names a rank slower than its peers, and the
   incident watch (`incident_watch.py`), which sees restarts through to their first step;
6. enforces the shutdown budget: once draining for `shutdown_timeout_s`, it kills the ranks;
7. hands the views to the progress sink (`progress.py`): the live status line on a terminal,
   `progress` log events off it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

import structlog

from daemon._lifecycle import kill_group, pid_alive
from daemon.agent.hang import HangDetector
from daemon.agent.http import health
from daemon.agent.incident_watch import IncidentWatch
from daemon.agent.notify import Notifier, TimeoutExtender
from daemon.agent.progress import ProgressSink
from daemon.agent.straggler import StragglerWatch
from daemon.observe.collector import RankView, SnapshotAggregator
from daemon.observe.state import NodePhase, NodeState
from daemon.observe.status import StatusBoard
from daemon.rundir.snapshot import RankPhase

__all__ = ["Supervisor"]

log = structlog.get_logger("trainingd.supervisor")

_TICK_S = 0.25
_STATUS_EVERY_S = 5.0
_EXTEND_EVERY_S = 5.0
_EXTEND_WINDOW_S = 60.0
"""Each EXTEND_TIMEOUT_USEC grants 60 s from now (a 64 MiB restore read at 1 MB/s); sent at most
every 5 s, and only after progress ([Note: extend systemd's timeouts only while the node makes
progress] in `notify.py`)."""

_LOADING = frozenset({RankPhase.STARTING, RankPhase.LOADING, RankPhase.RESTORING})
_SAVING = frozenset({RankPhase.CHECKPOINTING, RankPhase.STOPPING, RankPhase.FINISHING})


def derive_phase(views: list[RankView], local_ranks: int) -> tuple[NodePhase, int | None]:
    """Node phase and lowest step from the current incarnation's rank views.

    A rank that is `finished` or `exited` has left its group: the phase comes from the ranks
    still in it. None left: the group has ended and the next one, if any, is forming
    (`rendezvous`, as when their processes are gone; a node whose run ended is set to `stopped`
    by the daemon itself, which derived phases never override).
    """
    if not views:
        return NodePhase.RENDEZVOUS, None
    newest = max(v.restart for v in views)
    current = [v for v in views if v.restart == newest]
    steps = [int(v.gauge("trainingd_train_step") or 0) for v in current]
    step = min(steps) if steps else None
    in_group = [v for v in current if not v.phase.done]
    if not in_group:
        return NodePhase.RENDEZVOUS, step
    phases = {v.phase for v in in_group}
    if len(current) < local_ranks or phases & _LOADING:
        return NodePhase.LOADING, step
    if phases & _SAVING:
        return NodePhase.CHECKPOINTING, step
    return NodePhase.TRAINING, step


class Supervisor:
    """Runs the supervisor loop on its own thread.

    Args:
        state: node state to update.
        aggregator: local rank snapshots.
        notifier: sd_notify sender.
        heartbeat_timeout_s: rank heartbeat age beyond which the node is unhealthy.
        shutdown_timeout_s: draining budget before ranks are killed.
        progress: where the node's progress goes every tick (live line or events), or None.
        board: the status page's board, fed every tick, or None.
        hangs: the hang detector, fed every tick, or None (`hang.py`).
        stragglers: the straggler watch, fed every tick, or None (`straggler.py`).
        incidents: the incident watch, fed every tick, or None (`incident_watch.py`).
    """

    def __init__(
        self,
        state: NodeState,
        aggregator: SnapshotAggregator,
        notifier: Notifier,
        *,
        heartbeat_timeout_s: float,
        shutdown_timeout_s: float,
        progress: ProgressSink | None = None,
        board: StatusBoard | None = None,
        hangs: HangDetector | None = None,
        stragglers: StragglerWatch | None = None,
        incidents: IncidentWatch | None = None,
    ) -> None:
        self._incidents = incidents
        self._board = board
        self._hangs = hangs
        self._stragglers = stragglers
        self._state = state
        self._aggregator = aggregator
        self._notifier = notifier
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._progress = progress
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._reaped: set[int] = set()
        self._views: list[RankView] = []
        self._sent_ready = False
        self._last_status = float("-inf")
        self._extender = TimeoutExtender(
            notifier, window_s=_EXTEND_WINDOW_S, every_s=_EXTEND_EVERY_S
        )
        self._draining_since: float | None = None
        self._world_size = 0
        self.budget_exceeded = threading.Event()
        """Set when draining outlived `shutdown_timeout_s` and the ranks were killed."""
        self._ticks = 0  # ticks ended (`end_progress` waits on them)
        self._ticked = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="trainingd-supervisor", daemon=True)

    def start(self) -> Supervisor:
        """Start the loop; returns self."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def rank_heartbeats(self) -> list[float]:
        """Last heartbeat of every live local rank of the current incarnation (for /healthz)."""
        with self._lock:
            views = list(self._views)
        return [
            hb
            for v in views
            if v.phase is not RankPhase.EXITED
            and (hb := v.gauge("trainingd_rank_heartbeat_timestamp_seconds")) is not None
        ]

    def kill_all(self) -> None:
        """SIGKILL every rank process group this node has seen (and their writers)."""
        with self._lock:
            groups = set(self._groups)
        for pgid in groups:
            kill_group(pgid)

    def end_progress(self, timeout_s: float = 2.0) -> None:
        """The ranks have ended: wait until a whole tick has read their last views (the tick
        in flight may have read them before), then let the progress sink show the end."""
        with self._ticked:
            target = self._ticks + 2
            if self._thread.is_alive():
                self._ticked.wait_for(lambda: self._ticks >= target, timeout_s)
        if self._progress is not None:
            self._progress.finish()

    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self.tick()
            except Exception:  # the loop must survive a torn file or a transient OSError
                log.exception("supervisor_tick_failed")
            with self._ticked:
                self._ticks += 1
                self._ticked.notify_all()

    def tick(self, now: float | None = None) -> None:
        """One supervisor iteration (public for tests)."""
        now = time.monotonic() if now is None else now
        views = self._aggregator.refresh()
        with self._lock:
            self._views = views
            self._groups.update(v.pid for v in views if v.pid not in self._reaped)
            dead = {g for g in self._groups if not pid_alive(g)}
            self._groups -= dead
            self._reaped |= dead
        for pgid in dead:
            # The rank is gone; whatever it spawned (checkpoint writers) goes with it.
            if kill_group(pgid):
                log.warning("killed_orphaned_rank_group", pgid=pgid)
        if self._hangs is not None and self._draining_since is None:
            self._hangs.observe(views)
        if self._stragglers is not None and self._draining_since is None:
            self._stragglers.observe(views)
        if self._incidents is not None:
            self._incidents.observe(views)
        phase, step = derive_phase([v for v in views if pid_alive(v.pid)], self._local_ranks())
        if step is None:
            # Every rank has exited: their last published steps are still the node's progress
            # (a short run can train, publish and exit between two ticks).
            _, step = derive_phase(views, self._local_ranks())
        status = self._state.update(
            phase=phase,
            world_size=max((v.world_size for v in views), default=None),
            restarts=max((v.restart for v in views), default=None),
            step=step,
        )
        if status.world_size != self._world_size:
            if self._world_size:
                # The job shrank or grew (elastic `--nnodes MIN:MAX`): a new membership round.
                log.info(
                    "membership_changed",
                    old_world_size=self._world_size,
                    new_world_size=status.world_size,
                    step=status.step,
                )
            self._world_size = status.world_size
        self._notify(status.phase, status.ready, views, now)
        if self._board is not None:
            self._board.observe(views, status)
        if status.phase is NodePhase.DRAINING:
            self._enforce_budget(now)
        if self._progress is not None:
            self._progress.observe(views, status, now)

    def _local_ranks(self) -> int:
        return self._state.status().local_ranks

    def _notify(self, phase: NodePhase, ready: bool, views: list[RankView], now: float) -> None:
        if ready and not self._sent_ready:
            self._sent_ready = True
            self._notifier.send(READY=1, STATUS=f"training from step {self._state.status().step}")
            log.info("ready", step=self._state.status().step)
        if now - self._last_status >= _STATUS_EVERY_S and views:
            self._last_status = now
            loss = views[0].gauge("trainingd_train_loss")
            text = f"{phase.value}: step {self._state.status().step}"
            self._notifier.send(STATUS=text + (f", loss {loss:.4f}" if loss is not None else ""))
        ok, _ = health(self._state, self.rank_heartbeats, self._heartbeat_timeout_s)
        if ok:
            self._notifier.watchdog(now)
        slow = phase in (NodePhase.RENDEZVOUS, NodePhase.LOADING, NodePhase.DRAINING)
        if slow:
            self._extender.observe(_progress_mark(phase, views), now)

    def _enforce_budget(self, now: float) -> None:
        if self._draining_since is None:
            self._draining_since = now
        elif now - self._draining_since > self._shutdown_timeout_s:
            if not self.budget_exceeded.is_set():
                log.error("shutdown_budget_exceeded", budget_s=self._shutdown_timeout_s)
                self.budget_exceeded.set()
            self.kill_all()


def _progress_mark(phase: NodePhase, views: list[RankView]) -> Hashable:
    """What changes when the node moves: phase, membership, each rank's phase, step and beat."""
    ranks = tuple(
        (
            v.local_rank,
            v.restart,
            v.world_size,
            v.phase,
            v.gauge("trainingd_train_step"),
            v.gauge("trainingd_rank_heartbeat_timestamp_seconds"),
        )
        for v in sorted(views, key=lambda v: v.local_rank)
    )
    return phase, ranks
