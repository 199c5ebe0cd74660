"""Durable saves put off while an earlier one is still being written: counted, logged, owed.

[Note: a durable save never stalls the loop]
`CheckpointManager.save()` is collective and, with `max_inflight` saves in flight, first waits
for the oldest to finish. While the store is unreachable or a writer is stuck, that wait was
the training loop's: a SIGSTOPped writer held every rank for 28 s, and a 30 s S3 outage showed
up as a slow step, never as a failed save. Now each rank asks its manager every step whether a
durable save would wait for a write still in flight (`write_in_flight()`: a non-blocking poll
of its writer) and the answer rides on the per-step all-reduce ([Note: one all-reduce per step
agrees on stop and checkpoint] in `loop.py`), so every rank sees the same "durable busy" flag
at the same step. A durable save due while the flag is up (scheduled by `ckpt_every`, or
requested) is deferred on every rank:

- it is counted once as `trainingd_ckpt_saves_total{result="deferred"}`; the first deferral of
  an episode logs one `checkpoint_deferred` line (the step in flight and how long it has been),
  and the episode's end one `checkpoint_caught_up` line, never one line per step;
- with the memory tier on, a memory snapshot of that step is taken instead (the newest state is
  on the node; a rank failure still costs at most the memory cadence);
- the durable save is owed: it is taken at the first step whose flag is down, from the state at
  that step, so the durable tier catches up by itself once the writer is free.

Without the memory tier the loop defers just the same: a stall would not make the newest
state any safer (it lives in the ranks' memory either way), it would only stop training. The
newest durable step then ages, which `TrainingdCheckpointTooOld` reports. The final save (the
last step, or a stop) is never deferred: it waits for the write in flight and must commit
(`SaveFailurePolicy`, the drain).

What is waited for: only a write still in progress on some rank defers. A save whose files are
written everywhere (or that already failed) is finalized by the next `save()` as before: the
agreement and its commit (one small object) take moments, and a failed save keeps its meaning
(`SaveFailedError`, counted `failed`). The writer's own limits are unchanged: the per-step
poll and `maybe_finalize` still fail a write past `write_timeout_s`, which ends the episode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import structlog

if TYPE_CHECKING:
    from ckpt_manager import ManagerStats

__all__ = ["DeferredSaves"]

log = structlog.get_logger("trainingd.checkpoint")


class _Counter(Protocol):
    def inc(self, name: str, amount: float = 1.0, label: str = "") -> None: ...


class DeferredSaves:
    """The loop's durable saves that were due while an earlier one was still being written.

    Args:
        telemetry: where `trainingd_ckpt_saves_total{result="deferred"}` is counted.
        clock: Unix time source (tests).
    """

    def __init__(self, telemetry: _Counter, clock: Callable[[], float] = time.time) -> None:
        self._telemetry = telemetry
        self._now = clock
        self.first_step: int | None = None
        """Step of the first deferred save of the current episode (None: nothing owed)."""
        self.num_deferred = 0
        """Saves deferred in the current episode."""
        self._since_unix_s = 0.0

    @property
    def owed(self) -> bool:
        """A deferred durable save has not been taken yet."""
        return self.first_step is not None

    def defer(self, step: int, stats: ManagerStats, *, due: bool) -> None:
        """Put off the durable save of `step`.

        Args:
            step: the step whose save is put off.
            stats: the manager's stats (the save in flight, for the episode's log line).
            due: the save was due at this step (scheduled or requested): count it. False:
                only the owed save is still waiting (counted when it was due).
        """
        if due:
            self.num_deferred += 1
            self._telemetry.inc("trainingd_ckpt_saves_total", 1.0, "deferred")
        if self.first_step is not None:
            return
        self.first_step, self._since_unix_s = step, self._now()
        since = stats.oldest_inflight_unix_s
        log.warning(
            "checkpoint_deferred",
            ckpt_step=step,
            inflight_step=stats.oldest_inflight_step,
            inflight_s=None if since is None else round(self._now() - since, 3),
            reason="an earlier durable save is still being written: training goes on, the "
            "save is taken at the first step after it",
        )

    def taken(self, step: int) -> None:
        """A durable save of `step` was started: an owed save (if any) is paid."""
        if self.first_step is None:
            return
        log.info(
            "checkpoint_caught_up",
            ckpt_step=step,
            deferred_from_step=self.first_step,
            num_deferred=self.num_deferred,
            deferred_s=round(self._now() - self._since_unix_s, 3),
        )
        self.first_step, self.num_deferred = None, 0
