"""The N-rank helper is itself tested: sums, tracebacks and hangs."""

from __future__ import annotations

import os
import pathlib
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


def _report_state(rank: int, world_size: int, tensors: list[torch.Tensor]) -> dict[str, object]:
    print(f"rank {rank} says hello on stdout", flush=True)
    tensors[0].add_(1)  # a copy: the parent's tensor must not change
    return {
        "cwd": os.getcwd(),
        "variable": os.environ.get("DIST_TEST_VARIABLE"),
        "sum": sum(float(t.sum()) for t in tensors),
    }


def test_ranks_see_the_starting_tests_environment_directory_and_a_copy_of_many_tensors(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Set after the fork server may have started: the rank must see this test's values.
    monkeypatch.setenv("DIST_TEST_VARIABLE", "set-by-the-test")
    monkeypatch.chdir(tmp_path)
    # More tensors than the fork server passes descriptors (256): arguments are copied.
    tensors = [torch.full((2,), float(i)) for i in range(300)]
    [state] = run_on_ranks(_report_state, 1, tensors, timeout_s=60)
    assert state == {
        "cwd": str(tmp_path),
        "variable": "set-by-the-test",
        "sum": 2.0 + sum(2.0 * i for i in range(300)),  # the rank added 1 to tensors[0]
    }
    assert torch.equal(tensors[0], torch.zeros(2))
    assert "rank 0 says hello on stdout" in capfd.readouterr().out


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
