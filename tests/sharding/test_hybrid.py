"""Hybrid sharding (HSDP, 2 replicas x 2 shards on 4 gloo ranks) against ZeRO-3.

One launch runs every configuration (`_hybrid_ranks.hybrid_and_zero3`): HSDP must train
like ZeRO-3 on 4 ranks, communicate per rank what ZeRO-3 on 2 ranks does plus one replica
all-reduce of the shard per reduce-scatter, and keep the replicas of a shard identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import Setup, make_model
from tests.sharding._hybrid_ranks import STEPS, hybrid_and_zero3
from tests.support.dist import run_on_ranks


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(hybrid_and_zero3, 4, timeout_s=300)


@pytest.mark.slow
def test_hybrid_zero3_matches_zero3_on_four_ranks(results: list[dict[str, Any]]) -> None:
    hybrid, zero3 = results[0]["hybrid"], results[0]["zero3"]
    assert hybrid["shape"] == (4, 2, 2)
    assert zero3["shape"] == (4, 4, 1)
    assert len(hybrid["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(hybrid["losses"], zero3["losses"], strict=True)) < 1e-5
    for name, weight in zero3["full"].items():
        torch.testing.assert_close(hybrid["full"][name], weight, rtol=1e-4, atol=1e-5)
    assert results[1]["hybrid"]["full"] == {}, "rank 0 of the world returns it, no other"


@pytest.mark.slow
def test_hybrid_zero1_and_zero2_train_like_zero3(results: list[dict[str, Any]]) -> None:
    zero3 = results[0]["zero3"]["losses"]
    for strategy in (Strategy.OPTIM, Strategy.OPTIM_GRADS):
        run = results[0][strategy.value]
        assert run["shape"] == (4, 2, 2)
        assert max(abs(a - b) for a, b in zip(run["losses"], zero3, strict=False)) < 1e-5


@pytest.mark.slow
def test_replicas_of_a_shard_hold_identical_main_weights(results: list[dict[str, Any]]) -> None:
    for key in ("hybrid", Strategy.OPTIM.value, Strategy.OPTIM_GRADS.value):
        for rank in (0, 1):
            mine, replica = results[rank][key], results[rank + 2][key]
            for a, b in zip(mine["main_weights"], replica["main_weights"], strict=True):
                assert torch.equal(a, b), key
        # ... and the two positions of a shard group hold different shards.
        first, second = results[0][key]["main_weights"], results[1][key]["main_weights"]
        assert not torch.equal(first[0], second[0])


@pytest.mark.slow
def test_sharded_state_dicts_round_trip_on_every_replica(results: list[dict[str, Any]]) -> None:
    for rank in results:
        for key in ("hybrid", Strategy.OPTIM.value, Strategy.OPTIM_GRADS.value):
            assert rank[key]["round_trip"], key


@pytest.mark.slow
def test_hybrid_communicates_like_two_rank_zero3_plus_one_replica_all_reduce(
    results: list[dict[str, Any]],
) -> None:
    for rank in results:
        hybrid, pair = rank["hybrid"]["collectives"], rank["pair"]["collectives"]
        assert hybrid["all_gather"] == pair["all_gather"]
        assert hybrid["reduce_scatter"] == pair["reduce_scatter"]
        count, num_bytes = hybrid["reduce_scatter"]
        # Per step one reduce-scatter per trained bucket; each is followed by one all-reduce
        # of its output shard (half the bucket at 2 shards) over the replica group.
        assert count == 2 * rank["hybrid"]["trained_buckets"]
        assert hybrid["all_reduce"] == (count, num_bytes // 2)
        assert pair["all_reduce"] == (0, 0)


@pytest.mark.slow
def test_a_group_size_that_does_not_fit_the_world_is_refused(
    results: list[dict[str, Any]],
) -> None:
    for rank in results:
        indivisible, subgroup = rank["errors"]
        assert "shard_group_size=3 does not divide the world size 4" in indivisible
        assert "use a divisor of it" in indivisible
        assert "needs the default process group" in subgroup


def test_shard_group_size_without_a_process_group_must_be_one() -> None:
    model = make_model(Setup(strategy=Strategy.OPTIM_GRADS_PARAMS, num_layers=1))
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        FullyShardedDataParallel(model, ShardingConfig(shard_group_size=2))
    wrapped = FullyShardedDataParallel(model, ShardingConfig(shard_group_size=1))
    assert (wrapped.world_size, wrapped.shard_group_size, wrapped.num_replicas) == (1, 1, 1)


def test_shard_group_size_is_validated() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ShardingConfig(shard_group_size=0)
    with pytest.raises(ValueError, match="int or None"):
        ShardingConfig(shard_group_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a sharded strategy"):
        ShardingConfig(strategy=Strategy.NO_SHARD, shard_group_size=2)
    assert ShardingConfig(shard_group_size=8).shard_group_size == 8
