"""`maybe_finalize` never waits for a peer: 2 real gloo ranks, one of them late.

[Note: a non-blocking finalize never waits for a peer] in `ckpt_manager/_save/finalize.py`.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest
import torch

from ckpt_manager import CheckpointConfig, CheckpointManager, SaveFailedError
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

CALLS = 20
"""`maybe_finalize` calls rank 0 makes while rank 1 takes no part."""
WAIT_S = 60.0
"""Bound of a rank's wait for the other's signal file (a hang guard, never reached)."""


def _wait_for(path: pathlib.Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _state(rank: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(rank)), "step": 1}


def _poll_until_failure(mgr: CheckpointManager) -> tuple[int, str]:
    """`maybe_finalize` until it raises; the calls made and the error."""
    for calls in range(100_000):  # far beyond the timeout's worth: the timeout ends it first
        try:
            mgr.maybe_finalize()
        except SaveFailedError as err:
            return calls, str(err)
        time.sleep(0.005)
    raise AssertionError("an unanswered poll never failed the save")


def _late_peer(rank: int, world: int, root: str, signals: str) -> dict[str, Any]:
    """Rank 1 joins the finalize only after rank 0 made `CALLS` calls; then it commits.
    Then rank 1 never joins a second save's finalize: rank 0's polls fail it within the
    finalize timeout."""
    go, failed = pathlib.Path(signals, "go"), pathlib.Path(signals, "failed")
    out: dict[str, Any] = {}
    # A blocking poll would sit in the all-reduce for rank 1 until this timeout ran out.
    cfg = CheckpointConfig(finalize_timeout_s=10)
    with CheckpointManager(f"{root}/late", cfg, run_id="late-peer") as mgr:
        mgr.save(1, _state(rank))
        mgr.before_optimizer_step()
        if rank == 0:
            for _ in range(CALLS):
                mgr.maybe_finalize()
            out["calls"] = len(mgr.stats().recent_finalize_call_s)
            out["inflight_while_late"] = mgr.stats().inflight
            go.touch()
        else:
            _wait_for(go)  # stands for a rank that is stopped or busy in a long step
        mgr.wait_until_finished()
        out["steps"] = mgr.all_steps()
    with CheckpointManager(
        f"{root}/absent", CheckpointConfig(finalize_timeout_s=2), run_id="absent-peer"
    ) as mgr:
        mgr.save(2, _state(rank))
        mgr.before_optimizer_step()
        if rank == 0:
            out["absent"] = _poll_until_failure(mgr)
            out["inflight_after_failure"] = mgr.stats().inflight
            failed.touch()
        else:
            _wait_for(failed)
            with pytest.raises(SaveFailedError, match="step 2"):
                mgr.wait_until_finished()
    return out


def test_maybe_finalize_returns_while_a_peer_is_late_and_commits_once_it_joins(
    tmp_path: pathlib.Path,
) -> None:
    signals = tmp_path / "signals"
    signals.mkdir()
    rank0, rank1 = run_on_ranks(_late_peer, 2, str(tmp_path), str(signals), timeout_s=120)
    # Every call returned although rank 1 issued no collective meanwhile; the save waited.
    assert rank0["calls"] == CALLS
    assert rank0["inflight_while_late"] == 1
    assert rank0["steps"] == rank1["steps"] == [1]
    # An unanswered poll still fails the save (on the training thread's next calls) once
    # the finalize timeout has passed: after many calls, never a hang.
    calls, error = rank0["absent"]
    assert calls > 1
    assert "step 2" in error
    assert "did not complete" in error or "timed out" in error.lower()
    assert rank0["inflight_after_failure"] == 0
