"""All-gathers on gloo by point-to-point exchange ([Note: gloo all-gather] in `_comm.py`)."""

from __future__ import annotations

import torch

from tests.sharding._comm_ranks import SIZES, _shard, gathers_in_flight
from tests.support.dist import run_on_ranks


def _expected(size: int, n: int, salt: int) -> torch.Tensor:
    return torch.cat([_shard(r, n, salt) for r in range(size)])


def _check(result: dict) -> None:
    size = result["size"]
    assert result["exchange"]  # gloo: the exchange, not gloo's all-gather
    for salt, (n, out) in enumerate(zip(SIZES, result["outputs"], strict=False)):
        assert torch.equal(out, _expected(size, n, salt)), (n, out[:4])
    assert torch.equal(result["outputs"][-1], _expected(size, 7, 99))
    assert torch.equal(result["job_msg"], torch.full((3,), float(result["source"])))


def test_gathers_in_flight_over_the_world_match_the_shards_in_rank_order() -> None:
    for result in run_on_ranks(gathers_in_flight, 3, None, timeout_s=120):
        _check(result)


def test_gathers_over_a_subgroup_use_its_ranks() -> None:
    # Ranks 2 and 0 (in that order: the group's rank 0 is global rank 0, its rank 1 is 2).
    results = run_on_ranks(gathers_in_flight, 3, [0, 2], timeout_s=120)
    assert results[1] == {"skipped": True}
    for result in (results[0], results[2]):
        assert result["size"] == 2
        _check(result)
