"""The run's failure policy for checkpoint saves: report, keep training, give up after N.

A save that fails (a store outage, a full disk, a writer that died) raises `SaveFailedError`
on every rank at the same call, because the failure is agreed across ranks. Stopping training
for it would turn a transient storage problem into a lost run, so the loop hands its
checkpoint calls to `SaveFailurePolicy.guard`: a failed save is logged (the manager's observer
has already counted it in `trainingd_ckpt_saves_total{result="failed"}`, which the
`TrainingdCheckpointSaveFailed` alert watches) and training continues. After
`max_consecutive_save_failures` failures with no commit in between the run fails with
`CheckpointFailuresError`: checkpoints are clearly not coming back, and every further step
would be work that cannot be saved. Every rank counts the same agreed failures, so every rank
gives up at the same call.

Other checkpoint errors (a collective that timed out because a peer died) are not save
failures: they propagate, and the elastic agent restarts the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from ckpt_manager import SaveFailedError
from daemon.errors import CheckpointFailuresError

__all__ = ["SaveFailurePolicy"]

_T = TypeVar("_T")
_log = structlog.get_logger("trainingd.checkpoint")


class SaveFailurePolicy:
    """Counts consecutive failed saves of one manager; see the module docstring."""

    def __init__(self, manager: Any, max_consecutive: int) -> None:
        """Args:
        manager: the run's `CheckpointManager` (its stats tell commits apart).
        max_consecutive: failed saves in a row that end the run (1: the first does).
        """
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive={max_consecutive}: use 1 or more")
        self._manager = manager
        self.max_consecutive = max_consecutive
        """Failed saves in a row that end the run."""
        self.consecutive = 0
        """Failed saves since the last commit."""
        self._last_commit = manager.stats().last_committed_unix_s

    def guard(self, call: Callable[[], _T]) -> _T | None:
        """Run a checkpoint call; a failed save is logged and counted instead of raised.

        Returns:
            The call's result, or None when a save failed (and the run goes on).

        Raises:
            CheckpointFailuresError: the `max_consecutive`-th failure in a row.
        """
        try:
            result = call()
        except SaveFailedError as err:
            self._note_commit()  # a commit before this failure still resets the count
            self.consecutive += 1
            if self.consecutive >= self.max_consecutive:
                raise CheckpointFailuresError(
                    f"{self.consecutive} checkpoint saves failed in a row "
                    f"(max_consecutive_save_failures={self.max_consecutive}); last: {err}"
                ) from err
            _log.error(
                "checkpoint_failed_training_continues",
                ckpt_step=err.step,
                error=str(err),
                consecutive_failures=self.consecutive,
                max_consecutive_save_failures=self.max_consecutive,
            )
            return None
        self._note_commit()
        return result

    def _note_commit(self) -> None:
        committed = self._manager.stats().last_committed_unix_s
        if committed != self._last_commit:
            self._last_commit = committed
            self.consecutive = 0
