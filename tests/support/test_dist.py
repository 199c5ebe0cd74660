"""The N-rank helper is itself tested: sums, tracebacks and hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import RankFailedError, RankTimeoutError, run_on_ranks


def _all_reduce(rank: int, world_size: int, base: float) -> torch.Tensor:
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return t


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


def test_all_reduce_sum_on_two_ranks() -> None:
    results = run_on_ranks(_all_reduce, 2, 10.0, timeout_s=60)
    assert [r.item() for r in results] == [21.0, 21.0]


def test_rank_exception_surfaces_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout_s=60)
    msg = str(info.value)
    assert "rank 1 failed" in msg
    assert "ValueError: boom from rank one" in msg
    assert "_raise_on_rank_one" in msg


def test_hanging_rank_fails_within_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[0\]"):
        run_on_ranks(_hang_on_rank_zero, 2, timeout_s=8)
    # Spawn start-up plus the 8 s limit plus kill; far below the 600 s sleep.
    assert time.monotonic() - start < 30
