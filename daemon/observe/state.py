"""The node's lifecycle state: what `/healthz`, `/readyz`, sd_notify and the metrics report.

One `NodeState` per daemon process, written by the supervisor thread (and the signal handler's
`request_stop`), read by HTTP handler threads and the metrics collector; a lock guards it.

State machine (`NodePhase`):

    starting -> rendezvous -> loading -> training <-> checkpointing
        any -> draining (first SIGTERM/SIGINT) -> stopped
    A worker group that ended (its ranks finished or exited) goes back to rendezvous: a restart
    or the next membership round follows, or the daemon stops; `ready` stays false until every
    local rank has finished its restore again. The supervisor derives the phase from the rank
    phases (`daemon.agent.supervisor.derive_phase`).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable

__all__ = ["ENDED_PHASES", "READY_PHASES", "NodePhase", "NodeState", "NodeStatus"]


class NodePhase(enum.StrEnum):
    """Lifecycle of one node (values of the `state` label of `trainingd_daemon_state`)."""

    STARTING = "starting"
    """Config validated, HTTP server up, no worker started yet."""
    RENDEZVOUS = "rendezvous"
    """Workers started (or restarted) and joining the job, no rank has reported yet; or the
    ranks left their group (finished or exited) and the next one has not reported yet."""
    LOADING = "loading"
    """Some local rank is building its model or restoring a checkpoint."""
    TRAINING = "training"
    """Every local rank is in its training loop."""
    CHECKPOINTING = "checkpointing"
    """Training, with a local rank blocked in a checkpoint save."""
    DRAINING = "draining"
    """A stop was requested: ranks finish the step, save a final checkpoint and exit."""
    STOPPED = "stopped"
    """Workers have exited."""


READY_PHASES = frozenset({NodePhase.TRAINING, NodePhase.CHECKPOINTING})
ENDED_PHASES = frozenset({NodePhase.DRAINING, NodePhase.STOPPED})
"""The node is ending its run on purpose (`trainingd_daemon_finished`)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class NodeStatus:
    """A consistent copy of `NodeState` at one instant."""

    phase: NodePhase
    """Current lifecycle phase."""
    ready: bool
    """Rendezvous and restore finished (what `/readyz` reports)."""
    heartbeat_unix_s: float
    """Last supervisor-loop iteration."""
    start_unix_s: float
    """Daemon process start."""
    world_size: int
    """Ranks in the job as of the last rendezvous (0 before the first)."""
    local_ranks: int
    """Rank processes on this node."""
    restarts: int
    """Worker-group restarts seen on this node."""
    step: int | None
    """Lowest current step over the local ranks (None before the first step)."""


class NodeState:
    """Thread-safe lifecycle state of the node.

    Args:
        local_ranks: rank processes this node runs.
        clock: Unix time source.
    """

    def __init__(self, *, local_ranks: int, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._status = NodeStatus(
            phase=NodePhase.STARTING,
            ready=False,
            heartbeat_unix_s=now,
            start_unix_s=now,
            world_size=0,
            local_ranks=local_ranks,
            restarts=0,
            step=None,
        )

    def status(self) -> NodeStatus:
        """Return a consistent copy of the current state."""
        with self._lock:
            return self._status

    def update(
        self,
        *,
        phase: NodePhase | None = None,
        world_size: int | None = None,
        restarts: int | None = None,
        step: int | None = None,
    ) -> NodeStatus:
        """Record a supervisor-loop iteration (the heartbeat) and any changed facts.

        A phase change is ignored once draining or stopped, except to `stopped`: a stop request
        is never undone by a late rank report. Returns the new status.
        """
        with self._lock:
            cur = self._status
            new_phase = cur.phase
            if phase is not None:
                final = cur.phase in (NodePhase.DRAINING, NodePhase.STOPPED)
                if not final or phase is NodePhase.STOPPED:
                    new_phase = phase
            self._status = dataclasses.replace(
                cur,
                phase=new_phase,
                ready=new_phase in READY_PHASES,
                heartbeat_unix_s=self._clock(),
                world_size=cur.world_size if world_size is None else world_size,
                restarts=cur.restarts if restarts is None else max(cur.restarts, restarts),
                step=cur.step if step is None else step,
            )
            return self._status

    def request_stop(self) -> bool:
        """Enter `draining`; returns False if a stop was already requested."""
        with self._lock:
            if self._status.phase in (NodePhase.DRAINING, NodePhase.STOPPED):
                return False
            self._status = dataclasses.replace(self._status, phase=NodePhase.DRAINING, ready=False)
            return True
