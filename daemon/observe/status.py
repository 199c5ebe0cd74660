"""What the status page (`/`) and `/api/status` show: progress, loss history, checkpoints, tiers.

`StatusBoard` is fed by the supervisor thread (`observe`, every tick, with the same rank views
`/metrics` uses) and read by HTTP handler threads (`snapshot`). It keeps what no single
snapshot holds: the loss history (one point per new step seen, the last `HISTORY_POINTS`),
the validation loss history (`val_loss`: one point per evaluation, from `trainingd_val_loss`
at `trainingd_val_step`), a tokens/s and steps/s estimate over a sliding window, the last
error seen on this node, and its last rank failures (`failures`: rank, reason, step, error;
`note_failure`, from `daemon/agent/failures.py`).

The checkpoint list comes from ckpt_manager's torch-free `committed_checkpoints`, read by the
board's own thread at most every `CHECKPOINT_REFRESH_S`, so a slow object store never blocks
an HTTP request: handlers only copy the last list.

The tiers (`tiers` in `/api/status`): the memory tier's bytes on this node by kind (`local`,
`replica`; the same reading as `trainingd_memory_tier_bytes`, taken on the supervisor's tick,
never in a request), the newest step the node's ranks hold in memory (the lowest over its
local ranks: a memory step is restorable only when every rank holds it) and the newest
durable step (the ranks' last commit, else the newest step of the listing).

The hangs (`hangs` in `/api/status`, `hung` on each rank): the ranks hung now and every rank
of the last declared hang (rank, node, phase, step, innermost frame, stopped or not, cause or
waiter), read from the hang detector's `HangLedger` (`daemon/observe/hangs.py`).

The stragglers (`stragglers` in `/api/status`, `straggler_score` and `straggler` on each rank):
each local rank's score, the ranks named stragglers now and the newest episodes (rank, node,
score, median compute seconds, when named and recovered), read from the straggler watch's
`StragglerLedger` (`daemon/observe/stragglers.py`).

The incidents (`incidents` in `/api/status`, newest first): one story per fault (what, which
ranks and node, the cause, detection and recovery seconds, steps lost, the restore source,
open/recovered/fatal), read from the node's `IncidentLog` (`daemon/observe/incidents.py`).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from ckpt_manager import CheckpointError, CommittedCheckpoint, committed_checkpoints
from daemon.observe.collector import RankView
from daemon.observe.hangs import HangLedger
from daemon.observe.incidents import IncidentLog
from daemon.observe.state import NodeStatus
from daemon.observe.stragglers import StragglerLedger

__all__ = [
    "CHECKPOINT_REFRESH_S",
    "FAILURES_SHOWN",
    "HISTORY_POINTS",
    "StatusBoard",
    "format_duration",
]

log = structlog.get_logger("trainingd.status")

HISTORY_POINTS = 1000
"""Loss points kept for the curve (oldest dropped first)."""
CHECKPOINT_REFRESH_S = 3.0
"""How often the board re-reads the checkpoint root's committed steps."""
FAILURES_SHOWN = 5
"""Rank failures kept for the page (newest last)."""
_RATE_WINDOW_S = 10.0


def _score(view: RankView) -> float:
    """The rank's exported straggler score, whatever its `node` label (0 before one)."""
    return next(iter(view.gauges.get("trainingd_rank_straggler_score", {}).values()), 0.0)


def _counter(view: RankView, name: str, label: str = "") -> float:
    return view.counters.get(name, {}).get(label, 0.0)


def _val_point(views: list[RankView]) -> tuple[int, float] | None:
    """`(step, val_loss)` of the ranks' last evaluation; None before the first (step 0, NaN)."""
    for view in views:
        step, value = view.gauge("trainingd_val_step"), view.gauge("trainingd_val_loss")
        if step is not None and step > 0 and value is not None and math.isfinite(value):
            return int(step), value
    return None


class StatusBoard:
    """The node's progress as the status page shows it; thread-safe.

    Args:
        max_steps: the run's target step (for step N/M and the ETA).
        ckpt_uri: the checkpoint root to list.
        storage_options: fsspec options for that root.
        clock: Unix time source (tests).
        list_checkpoints: replaces `committed_checkpoints` (tests).
        tier_bytes: the memory tier's bytes by kind (`local`, `replica`), read at each
            `observe` (`daemon.agent.memory_dir.NodeMemoryDir.tier_bytes`); None: 0.
        hangs: the hang detector's ledger; None: no hang is ever shown.
        stragglers: the straggler watch's ledger; None: no straggler is ever shown.
        incidents: the node's incident log; None: no incident is ever shown.
        run_id: the run's id (`run_id` in `/api/status`).
    """

    def __init__(
        self,
        *,
        max_steps: int,
        ckpt_uri: str,
        storage_options: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        list_checkpoints: Callable[[], list[CommittedCheckpoint]] | None = None,
        tier_bytes: Callable[[], Mapping[str, float]] | None = None,
        hangs: HangLedger | None = None,
        stragglers: StragglerLedger | None = None,
        incidents: IncidentLog | None = None,
        run_id: str = "",
    ) -> None:
        self._incidents = incidents
        self._run_id = run_id
        self.max_steps = max_steps
        """The run's target step."""
        self._ckpt_uri = ckpt_uri
        self._list = list_checkpoints or (
            lambda: committed_checkpoints(ckpt_uri, storage_options, known=self._checkpoints)
        )
        self._clock = clock
        self._tier_bytes = tier_bytes
        self._hangs = hangs if hangs is not None else HangLedger()
        self._stragglers = stragglers if stragglers is not None else StragglerLedger()
        self._tiers: dict[str, Any] = _tiers({}, None, None)
        self._lock = threading.Lock()
        self._loss: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY_POINTS)
        # The validation loss, one point per evaluation (`daemon/rank/evaluation.py`).
        self._val_loss: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=HISTORY_POINTS
        )
        self._samples: collections.deque[tuple[float, float, int]] = collections.deque()
        self._ranks: list[dict[str, Any]] = []
        self._node: dict[str, Any] = {}
        self._checkpoints: list[CommittedCheckpoint] = []
        self._checkpoints_error: str | None = None
        self._last_error: dict[str, Any] | None = None
        self._failures: collections.deque[dict[str, Any]] = collections.deque(maxlen=FAILURES_SHOWN)
        self._restarts = 0
        self._failed_saves = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._refresh_checkpoints, name="trainingd-status", daemon=True
        )

    def start(self) -> StatusBoard:
        """Start the checkpoint-listing thread; returns self."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the checkpoint-listing thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def note_error(self, message: str) -> None:
        """Record `message` as the node's last error (shown on the page)."""
        with self._lock:
            self._last_error = {"message": message, "unix_s": self._clock()}

    def note_failure(self, failure: Mapping[str, Any], text: str) -> None:
        """Record a rank failure (`RankFailure.as_dict()`, and its one-line `text`).

        It becomes the node's last error and heads the page's failures.
        """
        now = self._clock()
        with self._lock:
            self._failures.append({**failure, "text": text, "unix_s": now})
            self._last_error = {"message": f"rank failed: {text}", "unix_s": now}

    def observe(self, views: list[RankView], status: NodeStatus) -> None:
        """Take in one supervisor tick: loss point, rates, rank heartbeats, errors."""
        now = self._clock()
        tokens = sum(_counter(v, "trainingd_train_tokens_total") for v in views)
        failed = sum(_counter(v, "trainingd_ckpt_saves_total", "failed") for v in views)
        loss = next((x for v in views if (x := v.gauge("trainingd_train_loss")) is not None), None)
        val_point = _val_point(views)
        step = status.step
        held = dict(self._tier_bytes()) if self._tier_bytes is not None else {}
        in_memory = [v.gauge("trainingd_memory_newest_step") for v in views]
        held_steps = [x for x in in_memory if x is not None]
        # Restorable from memory only when every local rank holds it: the lowest, if all do.
        memory_step = min(held_steps) if held_steps and len(held_steps) == len(views) else None
        committed = [v.gauge("trainingd_ckpt_last_committed_step") for v in views]
        durable_step = max((c for c in committed if c is not None), default=None)
        with self._lock:
            if (
                step is not None
                and loss is not None
                and (not self._loss or self._loss[-1][0] < step)
            ):
                self._loss.append((step, loss))
            if val_point is not None and (
                not self._val_loss or self._val_loss[-1][0] < val_point[0]
            ):
                self._val_loss.append(val_point)
            self._samples.append((now, tokens, step or 0))
            while len(self._samples) > 2 and now - self._samples[0][0] > _RATE_WINDOW_S:
                self._samples.popleft()
            if status.restarts > self._restarts:
                self._restarts = status.restarts
                cause = (
                    f"after {self._failures[-1]['text']}"
                    if self._failures
                    else "see the rank logs above the restart"
                )
                self._last_error = {
                    "message": f"worker group restarted (restart {status.restarts}); {cause}",
                    "unix_s": now,
                }
            if failed > self._failed_saves:
                self._failed_saves = failed
                self._last_error = {"message": "a checkpoint save failed", "unix_s": now}
            self._ranks = [
                {
                    "rank": v.rank,
                    "local_rank": v.local_rank,
                    "pid": v.pid,
                    "restart": v.restart,
                    "phase": v.phase.value,
                    "step": int(v.gauge("trainingd_train_step") or 0),
                    "heartbeat_age_s": _age(
                        now, v.gauge("trainingd_rank_heartbeat_timestamp_seconds")
                    ),
                    "hung": self._hangs.hung(v.rank),
                    "straggler_score": round(_score(v), 3),
                    "straggler": self._stragglers.straggler(v.rank),
                }
                for v in sorted(views, key=lambda v: v.local_rank)
            ]
            self._node = {
                "phase": status.phase.value,
                "step": status.step,
                "ready": status.ready,
                "world_size": status.world_size,
                "restarts": status.restarts,
                "start_unix_s": status.start_unix_s,
            }
            self._tiers = _tiers(held, memory_step, durable_step)

    def rates(self) -> tuple[float, float]:
        """Tokens/s and steps/s over the last few seconds (0 until two samples)."""
        with self._lock:
            return self._rates()

    def _rates(self) -> tuple[float, float]:
        if len(self._samples) < 2:
            return 0.0, 0.0
        (t0, tok0, s0), (t1, tok1, s1) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return 0.0, 0.0
        return max(0.0, (tok1 - tok0) / (t1 - t0)), max(0.0, (s1 - s0) / (t1 - t0))

    def eta_s(self) -> float | None:
        """Seconds to `max_steps` at the current steps/s (None until it is known)."""
        with self._lock:
            return self._eta_s(self._rates()[1])

    def _eta_s(self, steps_per_s: float) -> float | None:
        remaining = self.max_steps - (self._node.get("step") or 0)
        return remaining / steps_per_s if steps_per_s > 0 and remaining > 0 else None

    def snapshot(self) -> dict[str, Any]:
        """The JSON body of `/api/status` (see README, Status page)."""
        now = self._clock()
        with self._lock:
            tokens_per_s, steps_per_s = self._rates()
            step = self._node.get("step")
            eta = self._eta_s(steps_per_s)
            return {
                "now_unix_s": now,
                "run_id": self._run_id,
                "node": dict(self._node),
                "step": step,
                "max_steps": self.max_steps,
                "eta_s": None if eta is None else round(eta, 1),
                "tokens_per_s": round(tokens_per_s, 1),
                "steps_per_s": round(steps_per_s, 3),
                "loss": [[s, x] for s, x in self._loss],
                "val_loss": [[s, x] for s, x in self._val_loss],
                "ranks": [dict(r) for r in self._ranks],
                "checkpoints": {
                    "uri": self._ckpt_uri,
                    "error": self._checkpoints_error,
                    "committed": [
                        {
                            "step": c.step,
                            "size_bytes": c.size_bytes,
                            "age_s": round(now - c.committed_unix_s, 1),
                        }
                        for c in self._checkpoints
                    ],
                },
                "tiers": self._tier_view(),
                "hangs": {
                    "hung_ranks": self._hangs.hung_ranks(),
                    "last": [r.as_dict() for r in self._hangs.last()],
                },
                "stragglers": {
                    "ranks": self._stragglers.stragglers(),
                    "recent": [r.as_dict() for r in self._stragglers.recent()],
                },
                "incidents": [
                    i.as_dict() for i in (self._incidents.recent() if self._incidents else [])
                ],
                "last_error": None if self._last_error is None else dict(self._last_error),
                "failures": [dict(f) for f in self._failures],
                "endpoints": ["/", "/api/status", "/metrics", "/healthz", "/readyz"],
            }

    def _tier_view(self) -> dict[str, Any]:
        """The tiers, the durable step falling back to the listing (caller holds the lock)."""
        tiers = dict(self._tiers)
        if tiers["newest_durable_step"] is None and self._checkpoints:
            tiers["newest_durable_step"] = self._checkpoints[-1].step
        return tiers

    def refresh_checkpoints(self) -> None:
        """List the root's committed steps now (the board's thread calls this; tests too)."""
        try:
            found, error = self._list(), None
        except CheckpointError as err:
            found, error = None, str(err)
        with self._lock:
            if found is not None:
                self._checkpoints = found
            self._checkpoints_error = error

    def _refresh_checkpoints(self) -> None:
        while True:
            try:
                self.refresh_checkpoints()
            except Exception:  # the page must not lose its thread to one odd listing
                log.exception("status_checkpoint_listing_failed")
            if self._stop.wait(CHECKPOINT_REFRESH_S):
                return


def format_duration(seconds: float | None) -> str:
    """`1h 2m 3s` style (the page's `dur()` in JS), `-` when unknown."""
    if seconds is None:
        return "-"
    total = round(seconds)
    hours, minutes, secs = total // 3600, total % 3600 // 60, total % 60
    out = f"{hours}h " if hours else ""
    out += f"{minutes}m " if hours or minutes else ""
    return out + f"{secs}s"


def _tiers(
    held: Mapping[str, float], memory_step: float | None, durable_step: float | None
) -> dict[str, Any]:
    return {
        "memory_local_bytes": int(held.get("local", 0.0)),
        "memory_replica_bytes": int(held.get("replica", 0.0)),
        "newest_memory_step": None if memory_step is None else int(memory_step),
        "newest_durable_step": None if durable_step is None else int(durable_step),
    }


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 2)
