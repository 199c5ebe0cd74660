"""Rank functions of the stats and memory tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from daemon.gpt import Block, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, ShardingStatsSnapshot, Strategy
from tests.sharding._helpers import Setup, batch, make_model

ZERO3 = Strategy.OPTIM_GRADS_PARAMS


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    def on_collective(self, op: str, num_bytes: int, seconds: float) -> None:
        self.calls.append((op, num_bytes, seconds))


def _build(config: ShardingConfig, observer: Any = None) -> FullyShardedDataParallel:
    setup = Setup(strategy=config.strategy, num_layers=4)
    return FullyShardedDataParallel(make_model(setup), config, observer=observer)


def _train(model: FullyShardedDataParallel, opt: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, 0, rank, 2)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _persistent_bytes(model: FullyShardedDataParallel, opt: Any) -> int:
    total = 0
    for bucket in model._engine.buckets:
        for t in (bucket.main_weight, bucket.main_grad, bucket.reduced_grad):
            total += 0 if t is None else t.numel() * t.element_size()
        if bucket.param_shard is not None and bucket.param_shard is not bucket.main_weight:
            total += bucket.param_shard.numel() * bucket.param_shard.element_size()
        if not bucket.strategy.shards_params:
            full = bucket.full_param
            if full.untyped_storage().data_ptr() != bucket.main_weight.untyped_storage().data_ptr():
                total += full.numel() * full.element_size()
    for state in opt.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def stats_and_memory(rank: int, world: int) -> dict[str, Any]:
    """Steady-state prefetch counts, queue peaks, observer calls and buffer memory."""
    out: dict[str, Any] = {"prefetch": {}, "reduce_peak": {}}
    for prefetch in (True, False):
        recorder = _Recorder()
        model = _build(ShardingConfig(unit_modules=(Block,), prefetch=prefetch), recorder)
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        _train(model, opt, range(2), rank)
        before = model.stats.snapshot()
        _train(model, opt, range(2, 3), rank)
        after = model.stats.snapshot()
        out["prefetch"][prefetch] = {
            "before": before,
            "after": after,
            "units": model.num_units,
            "observer_calls": len(recorder.calls),
        }
        if prefetch:
            engine = model._engine
            assert engine.gather is not None
            units = [g.nbytes for g in engine.gather.units]
            out["peak_unsharded"] = engine.gather.peak_unsharded_bytes
            out["unit_bytes"] = units
            out["released"] = all(
                b.full_param.untyped_storage().nbytes() == 0 for b in engine.buckets
            )
            # Measured with gradients present (they are dropped by zero_grad).
            x, y = batch(9, 0, rank, 2)
            lm_loss(model(x), y).backward()
            out["zero3_bytes"] = _persistent_bytes(model, opt)
    for bound in (1, 2, 3):
        config = ShardingConfig(unit_modules=(Block,), max_inflight_reductions=bound)
        model = _build(config)
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        _train(model, opt, range(2), rank)
        out["reduce_peak"][bound] = model.stats.snapshot().reduce_queue_depth_peak
    model = _build(dataclasses.replace(ShardingConfig(), strategy=Strategy.NO_SHARD))
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    _train(model, opt, range(1), rank)
    x, y = batch(9, 0, rank, 2)
    lm_loss(model(x), y).backward()
    out["noshard_bytes"] = _persistent_bytes(model, opt)
    return out


def delta(after: ShardingStatsSnapshot, before: ShardingStatsSnapshot) -> tuple[int, int]:
    """(hits, misses) between two snapshots."""
    return (
        after.prefetch_hits - before.prefetch_hits,
        after.prefetch_misses - before.prefetch_misses,
    )
