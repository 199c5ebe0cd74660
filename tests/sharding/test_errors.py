"""Mistakes a user can make get clear errors (single process, world size 1)."""

from __future__ import annotations

import pytest
import torch

from daemon import Block, lm_loss
from sharding import FullyShardedDataParallel, ShardedTensor, ShardingConfig, Strategy
from sharding.errors import (
    DeferredInitError,
    DeviceMismatchError,
    GradientsInEngineError,
    ShardingError,
    StateDictLayoutError,
    UnwrappedModuleError,
)
from tests.sharding._helpers import Setup, make_model


def _wrapped(strategy: Strategy = Strategy.OPTIM_GRADS_PARAMS) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(
        make_model(Setup(strategy=strategy)),
        ShardingConfig(strategy=strategy, unit_modules=(Block,)),
    )


def test_module_on_another_device_is_rejected() -> None:
    with pytest.raises(DeviceMismatchError, match=r"module\.to\('meta'\)"):
        FullyShardedDataParallel(make_model(Setup(strategy=Strategy.NO_SHARD)), device="meta")


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_calling_the_unwrapped_module_is_rejected(strategy: Strategy) -> None:
    model = _wrapped(strategy)
    x = torch.randint(0, 256, (2, 16))
    with pytest.raises(UnwrappedModuleError, match="call the FullyShardedDataParallel wrapper"):
        lm_loss(model.module(x), x).backward()
    # The wrapper itself still works afterwards.
    lm_loss(model(x), x).backward()


def test_gradients_produced_outside_the_engine_are_rejected_at_step() -> None:
    model = _wrapped(Strategy.NO_SHARD)
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    param = next(model.module.parameters())
    with pytest.raises(GradientsInEngineError, match="make_optimizer"):
        param.grad = torch.ones_like(param)
    (param * 2).sum().backward()  # a graph built outside the wrapper's forward
    with pytest.raises(UnwrappedModuleError, match="never reduced"):
        opt.step()


def test_state_dict_saved_with_another_layout_is_rejected() -> None:
    model = _wrapped()
    sd = model.sharded_state_dict()
    piece = sd["tok_emb.weight"]
    assert isinstance(piece, ShardedTensor)
    assert piece.flat_range is not None
    half = piece.flat_range[1] // 2
    sd["tok_emb.weight"] = ShardedTensor(
        local=piece.local[:half],
        global_shape=piece.global_shape,
        global_offset=piece.global_offset,
        flat_range=(0, half),
    )
    with pytest.raises(StateDictLayoutError, match="another world size or strategy"):
        model.load_sharded_state_dict(sd)
    sd["tok_emb.weight"] = torch.zeros(3, 3)
    with pytest.raises(StateDictLayoutError, match="shape"):
        model.load_sharded_state_dict(sd)
    del sd["tok_emb.weight"]
    with pytest.raises(StateDictLayoutError, match="missing"):
        model.load_sharded_state_dict(sd)


def test_errors_share_one_base() -> None:
    for cls in (DeviceMismatchError, DeferredInitError, StateDictLayoutError):
        assert issubclass(cls, ShardingError)
        assert issubclass(cls, ValueError)
    assert issubclass(UnwrappedModuleError, ShardingError)
