"""A failed save found by `maybe_finalize` on one rank while its peer is already training.

[Note: a non-blocking finalize never waits for a peer] in `ckpt_manager/_save/finalize.py`:
each rank reads a poll round in whichever call finds it complete *on that rank*. On a loaded
machine the peer's gloo thread may not have marked the same round complete when the peer
polls, so the peer goes on into the next training step's collectives. When that round says a
save failed (a writer failed, or the commit did not happen), the rank that read it must not
sit in a collective of the checkpoint group that its peer will join only after the next
training collective: the two would wait for each other until the group's timeout (300 s by
default), which is how `tests/daemon/test_save_failures.py` hung on a loaded machine.

Here rank 1 is made to miss, once, the round that carries the failure (its `Pending.ready()`
answers False for that one call, as a late gloo thread would); between calls both ranks run a
training all-reduce on the default group. The failure must still reach both ranks promptly,
with every rank's cause, and the manager must go on saving.
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckpt_manager import CheckpointConfig, CheckpointManager, RankLocal, SaveFailedError
from ckpt_manager._coord import Pending, Status
from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._save.writer import FAULT_ENV
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
"""The checkpoint group's collective timeout: a rank left waiting in a collective fails then."""
MAX_STEPS = 3000
"""Training steps (`maybe_finalize`, then a training all-reduce) at most after the failing
save; training stops once both ranks raised the failure (a hang guard, never reached)."""
_NOT_COMMITTED = 2  # the COMMIT round's code when the coordinator did not commit
_FOREIGN_MANIFEST = b'{"run_id": "other-launch"}'


def _misses_the_failure_once() -> list[bool]:
    """Make `Pending.ready()` answer False once, for the first completed poll round that
    carries a failure (FAILED status or a commit that did not happen); returns a list that
    holds True once it did."""
    real = Pending.ready
    missed: list[bool] = []

    def ready(self: Pending[Any]) -> bool:
        if not real(self) or missed:
            return real(self)
        fields = self._finish()  # a poll round's MAX: [status, id, -id, nbytes, code, time]
        polled = isinstance(fields, list) and len(fields) == 6
        if polled and (fields[0] == Status.FAILED or fields[4] == _NOT_COMMITTED):
            missed.append(True)
            return False
        return True

    Pending.ready = ready  # type: ignore[method-assign]
    return missed


def _wait_for_own_failure(mgr: CheckpointManager) -> None:
    """Return once this rank's own part of the save in flight failed (local, no collective)."""
    deadline = time.monotonic() + 60  # a hang guard, never reached
    while time.monotonic() < deadline:
        try:
            mgr.check_for_errors()
        except SaveFailedError:
            return
        time.sleep(0.01)
    raise AssertionError("the injected writer fault never failed this rank's write")


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"w": RankLocal(torch.arange(1000, dtype=torch.float32) * step + rank)}


def _train_with_a_failing_save(
    rank: int, world: int, root: str, failing: int, conflict: bool = False
) -> dict[str, Any]:
    cfg = CheckpointConfig(finalize_timeout_s=TIMEOUT_S)
    with CheckpointManager(root, cfg, run_id="lagging-peer") as mgr:
        if conflict and rank == 0:  # another launch commits the step before this run does
            mgr.storage.write(f"{step_dir(failing)}/{MANIFEST_NAME}", _FOREIGN_MANIFEST)
        missed = _misses_the_failure_once() if rank == 1 else []
        mgr.save(failing, _state(rank, failing))
        mgr.before_optimizer_step()
        if not conflict:  # both writers' failures reach the round: every rank has a cause
            _wait_for_own_failure(mgr)
        t0 = time.monotonic()
        found: tuple[str, str, str] | None = None
        step = failing
        while step < failing + MAX_STEPS:
            step += 1
            time.sleep(0.02)  # forward/backward: the poll rounds complete meanwhile
            try:
                mgr.maybe_finalize()
            except SaveFailedError as err:
                found = (f"maybe_finalize at step {step}", str(err), type(err.__cause__).__name__)
            # The step's gradient reduction, which also stops training once both ranks know.
            knowing = torch.tensor([float(found is not None)])
            dist.all_reduce(knowing)
            if int(knowing.item()) == world:
                break
        try:
            mgr.wait_until_finished()
        except SaveFailedError as err:
            found = found or ("wait_until_finished", str(err), type(err.__cause__).__name__)
        elapsed = time.monotonic() - t0
        mgr.save(step + 1, _state(rank, step + 1))  # training goes on; the next save commits
        mgr.wait_until_finished()
        steps = mgr.all_steps()
        return {
            "found": found,
            "elapsed": elapsed,
            "steps": steps,
            "last": step + 1,
            "missed": missed,
        }


def _writer_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ[FAULT_ENV] = "raise@2"  # every rank's writer fails step 2
    try:
        return _train_with_a_failing_save(rank, world, root, 2)
    finally:
        del os.environ[FAULT_ENV]


def _commit_conflicts(rank: int, world: int, root: str) -> dict[str, Any]:
    return _train_with_a_failing_save(rank, world, root, 5, conflict=True)


def test_a_writer_failure_read_by_one_rank_reaches_both_without_a_timeout(
    tmp_path: pathlib.Path,
) -> None:
    out = run_on_ranks(_writer_fails, 2, str(tmp_path), timeout_s=4 * TIMEOUT_S + 60)
    assert out[1]["missed"] == [True]  # rank 1 did not see the failure when rank 0 did
    for rank_out in out:
        assert rank_out["found"] is not None
        where, error, _ = rank_out["found"]
        assert "step 2 failed" in error, where
        assert "rank 0: writer failed: RuntimeError: injected writer fault at step 2" in error
        assert "rank 1: writer failed: RuntimeError: injected writer fault at step 2" in error
        assert rank_out["elapsed"] < TIMEOUT_S  # no collective waited out the group timeout
        assert rank_out["steps"] == [rank_out["last"]]
        assert where.startswith("maybe_finalize"), where  # while training, not by the drain
    assert not (tmp_path / step_dir(2)).exists()


def test_a_commit_failure_read_by_one_rank_reaches_both_without_a_timeout(
    tmp_path: pathlib.Path,
) -> None:
    out = run_on_ranks(_commit_conflicts, 2, str(tmp_path), timeout_s=4 * TIMEOUT_S + 60)
    assert out[1]["missed"] == [True]
    for rank_out in out:
        assert rank_out["found"] is not None
        where, error, cause = rank_out["found"]
        assert "step 5 failed" in error, where
        assert cause == "CommitConflictError", error
        assert rank_out["elapsed"] < TIMEOUT_S
        assert rank_out["steps"] == [5, rank_out["last"]]  # the other launch's step 5 stays
        assert where.startswith("maybe_finalize"), where
    assert (tmp_path / step_dir(5) / MANIFEST_NAME).read_bytes() == _FOREIGN_MANIFEST
