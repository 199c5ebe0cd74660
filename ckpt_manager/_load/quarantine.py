"""A restore's corrupt steps moved aside, collectively, so the run can save their numbers again.

`restore_agreed` (`recover.py`) skips every committed step newer than the one it restores
that fails verification; those that are corrupt (not merely unreadable now: a storage error
may go away) are handed to `Quarantine.apply` once the restore has chosen its step. The
coordinator, holding the root's lease, moves each aside (`_store/quarantine.quarantine_step`,
[Note: a corrupt step is moved aside, never silently deleted]) and every rank learns the
outcome: which steps moved, and the newest committed step left, which becomes the manager's
newest saved step (a step is never written twice, so without this the run's save of the
quarantined step number would be refused).

[Note: the quarantine is waited for in short rounds] A move is one rename on local disk, but
on an object store every object is copied on the server (seconds to minutes for a large
step). The coordinator moves on a worker thread while every rank meets it in a short
broadcast every `POLL_S`, calling `beat` between rounds (the daemon's heartbeat), so neither
the checkpoint group's collective timeout nor the rank's liveness check sees a long move as
a hang. The whole quarantine is bounded by the group's timeout (`finalize_timeout_s`): a move
still running then is told to stop before its next step, and the outcome says which steps
stayed (the run then cannot save their numbers: the save says so, and `ckptctl prune
--corrupt` removes them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from ckpt_manager._coord import Coordinator
from ckpt_manager._store.quarantine import quarantine_step
from ckpt_manager._store.steps import committed_steps, read_manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError

__all__ = ["POLL_S", "Quarantine"]

POLL_S = 0.5
"""Period of the rounds in which every rank waits for the coordinator's moves."""

_log = structlog.get_logger("ckpt_manager")


class Quarantine:
    """What a restore needs to move corrupt steps aside; holds the outcome afterwards."""

    def __init__(
        self,
        storage: Storage,
        coord: Coordinator,
        *,
        run_id: str,
        fence: Callable[[], None] | None,
    ) -> None:
        """Prepare (nothing moves until `apply`).

        Args:
            storage: the root.
            coord: the restore's coordinator (its group and timeout).
            run_id: the run recorded as having moved the steps.
            fence: the coordinator's lease check (`Lease.confirm`), run before each move.
        """
        self._storage = storage
        self._coord = coord
        self._run_id = run_id
        self._fence = fence
        self.moved: list[int] = []
        """Steps moved aside by `apply` (every rank)."""
        self.failed: dict[int, str] = {}
        """Steps that stayed, and why (every rank)."""
        self.newest_committed: tuple[int, float] | None = None
        """The newest committed step left and its commit time, or None when none is (every
        rank; meaningful once `moved` is non-empty)."""

    def apply(self, steps: Sequence[tuple[int, str]], beat: Callable[[], None] | None) -> None:
        """Move the corrupt `(step, reason)` aside (collective: every rank, the same list).

        See [Note: the quarantine is waited for in short rounds]. Never raises for a storage
        problem or a lost lease (a step that stays is logged and kept in `failed`).

        Raises:
            CheckpointError: a round of the collective failed (a peer died).
        """
        if not steps:
            return
        worker: _Mover | None = None
        if self._coord.is_coordinator:
            worker = _Mover(self._storage, list(steps), self._run_id, self._fence)
        deadline = time.monotonic() + self._coord.timeout_s
        while True:
            outcome = None
            if worker is not None:
                if time.monotonic() > deadline:
                    worker.stop.set()
                    worker.thread.join(POLL_S)
                    outcome = worker.outcome(timed_out=not worker.done.is_set())
                elif worker.done.wait(POLL_S):
                    outcome = worker.outcome(timed_out=False)
            outcome = self._coord.broadcast(outcome)
            if outcome is not None:
                break
            if beat is not None:
                beat()
        self.moved = list(outcome["moved"])
        self.failed = dict(outcome["failed"])
        newest = outcome.get("newest")
        self.newest_committed = (int(newest[0]), float(newest[1])) if newest else None
        for step, why in sorted(self.failed.items()):
            _log.warning("ckpt_quarantine_failed", ckpt_step=step, error=why)


class _Mover:
    """The coordinator's worker thread: moves each step aside, then finds the newest left."""

    def __init__(
        self,
        storage: Storage,
        steps: list[tuple[int, str]],
        run_id: str,
        fence: Callable[[], None] | None,
    ) -> None:
        self._storage = storage
        self._steps = steps
        self._run_id = run_id
        self._fence = fence
        self.moved: list[int] = []
        self.failed: dict[int, str] = {}
        self.newest: tuple[int, float] | None = None
        self.stop = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ckpt-quarantine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for step, reason in self._steps:
                if self.stop.is_set():
                    self.failed[step] = "not moved: the quarantine ran out of time"
                    continue
                try:
                    quarantine_step(
                        self._storage, step, reason, run_id=self._run_id, fence=self._fence
                    )
                    self.moved.append(step)
                except CheckpointError as err:
                    self.failed[step] = f"{type(err).__name__}: {err}"
            self.newest = _newest_committed(self._storage)
        except Exception as err:  # never lose it: every rank waits for an outcome
            for step, _ in self._steps:
                if step not in self.moved:
                    self.failed.setdefault(step, f"{type(err).__name__}: {err}")
        finally:
            self.done.set()

    def outcome(self, *, timed_out: bool) -> dict[str, Any]:
        if not timed_out:
            return {"moved": list(self.moved), "failed": dict(self.failed), "newest": self.newest}
        # Cut short: the newest committed step left is unknown, so no move is reported and
        # the run keeps refusing every one of these step numbers (the safe side).
        why = "not confirmed within the checkpoint collective timeout"
        return {"moved": [], "failed": {s: self.failed.get(s, why) for s, _ in self._steps}}


def _newest_committed(storage: Storage) -> tuple[int, float] | None:
    steps = committed_steps(storage)
    if not steps:
        return None
    try:
        return (steps[-1], read_manifest(storage, steps[-1]).committed_unix_s)
    except CheckpointError:
        return (steps[-1], 0.0)
