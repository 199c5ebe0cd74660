"""Buffers (BatchNorm running statistics) against torch DDP on 2 ranks, per `BufferSync`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import BufferSync, ShardingConfig, Strategy
from tests.sharding._precision_ranks import batchnorm_buffers
from tests.support.dist import run_on_ranks

STEPS = 10
STRATEGIES = [Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_on_ranks(batchnorm_buffers, 2, STEPS, timeout_s=300)


def test_broadcast_is_the_default() -> None:
    assert ShardingConfig().buffer_sync is BufferSync.BROADCAST
    with pytest.raises(ValueError, match=r"BufferSync\.RANK_LOCAL"):
        ShardingConfig(buffer_sync="rank_local")  # type: ignore[arg-type]


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "broadcast_buffers"), [(BufferSync.BROADCAST, True), (BufferSync.RANK_LOCAL, False)]
)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=[s.value for s in STRATEGIES])
def test_running_stats_follow_ddp(
    runs: list[dict[str, Any]], mode: BufferSync, broadcast_buffers: bool, strategy: Strategy
) -> None:
    for rank in runs:
        _assert_same(rank[f"{mode.value}/{strategy.value}"], rank[f"ddp/{broadcast_buffers}"])


@pytest.mark.slow
def test_rank_local_stats_drift_apart_and_broadcast_ones_do_not(
    runs: list[dict[str, Any]],
) -> None:
    # The ranks see differently scaled data; after a step each rank has updated its own stats.
    key = "1.bn.running_mean"
    local = [r[f"rank_local/{Strategy.NO_SHARD.value}"][key] for r in runs]
    assert not torch.allclose(local[0], local[1], atol=1e-2)
    synced = [r[f"broadcast/{Strategy.NO_SHARD.value}"][key] for r in runs]
    # Rank 0's stats were broadcast before the last forward: both ranks updated from them,
    # so they differ only by one step's update (momentum 0.1) instead of ten.
    assert (synced[0] - synced[1]).abs().max() < (local[0] - local[1]).abs().max()
