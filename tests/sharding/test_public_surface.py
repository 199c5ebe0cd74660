"""The package's public names are deliberate."""

from __future__ import annotations

import sharding
import sharding.errors


def test_all_is_pinned_and_documented() -> None:
    assert sorted(sharding.__all__) == [
        "BufferSync",
        "CollectiveObserver",
        "CollectiveTotals",
        "DeferredInit",
        "DistributedOptimizer",
        "DynamicLossScale",
        "FullyShardedDataParallel",
        "MixedPrecisionPolicy",
        "NoSyncMode",
        "ShardedTensor",
        "ShardingConfig",
        "ShardingStats",
        "ShardingStatsSnapshot",
        "Strategy",
        "no_decay_groups",
    ]
    for name in sharding.__all__:
        assert getattr(sharding, name).__doc__, name
    assert "Module plan" in (sharding.__doc__ or "")
    assert "ShardingError" in (sharding.errors.__doc__ or "")
