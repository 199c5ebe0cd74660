"""`ShardingConfig` validation and `Strategy` semantics."""

from __future__ import annotations

import pytest
import torch

from sharding import NoSyncMode, ShardingConfig, Strategy


def test_defaults_are_zero3_fp32_with_prefetch() -> None:
    cfg = ShardingConfig()
    assert cfg.strategy is Strategy.OPTIM_GRADS_PARAMS
    assert cfg.param_dtype == torch.float32
    assert cfg.prefetch
    assert cfg.communication_unit_bytes is None
    assert cfg.no_sync_mode is NoSyncMode.REDUCE_SCATTER


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "optim"}, "sharding.Strategy"),
        ({"unit_modules": (torch.nn.Linear(2, 2),)}, "classes"),
        ({"bucket_size_bytes": 0}, "bucket_size_bytes"),
        ({"communication_unit_bytes": -1}, "communication_unit_bytes"),
        ({"param_dtype": torch.int8}, "param_dtype"),
        ({"max_inflight_reductions": 0}, "max_inflight_reductions"),
        ({"no_sync_mode": "accumulate_unsharded"}, "sharding.NoSyncMode"),
    ],
)
def test_invalid_values_say_how_to_fix(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardingConfig(**kwargs)  # type: ignore[arg-type]


def test_strategy_table() -> None:
    flags = {s: (s.shards_optimizer, s.shards_grads, s.shards_params) for s in Strategy}
    assert flags == {
        Strategy.NO_SHARD: (False, False, False),
        Strategy.OPTIM: (True, False, False),
        Strategy.OPTIM_GRADS: (True, True, False),
        Strategy.OPTIM_GRADS_PARAMS: (True, True, True),
    }
    assert Strategy("optim_grads_params") is Strategy.OPTIM_GRADS_PARAMS
