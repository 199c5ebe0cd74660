"""Rank functions of the stats and memory tests."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import torch

from daemon import Block, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, ShardingStatsSnapshot, Strategy
from sharding._param import engine_access
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


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (measured, not the engine's view).

    Walks the garbage collector's objects, so it sees whatever holds tensors (engine buffers,
    optimizer state, stray copies) without asking the engine what it allocated.
    """
    gc.collect()
    storages: dict[int, int] = {}
    with engine_access():  # reading a ZeRO-3 parameter's (empty) storage is fine here
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
                if ptr:
                    storages[ptr] = max(storages.get(ptr, 0), storage.nbytes())
    return sum(storages.values())


def stats_and_memory(rank: int, world: int) -> dict[str, Any]:
    """Steady-state prefetch counts, queue peaks, observer calls and resident tensor memory."""
    out: dict[str, Any] = {"prefetch": {}, "reduce_peak": {}, "reduce_step": {}}
    baseline = live_tensor_bytes()
    for prefetch in (True, False):
        recorder = _Recorder()
        start = time.perf_counter()
        model = _build(ShardingConfig(unit_modules=(Block,), prefetch=prefetch), recorder)
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        _train(model, opt, range(2), rank)
        before = model.stats.snapshot()
        _train(model, opt, range(2, 3), rank)
        after = model.stats.snapshot()
        wall_s = time.perf_counter() - start
        out["prefetch"][prefetch] = {
            "wall_s": wall_s,
            "observer_seconds": {
                op: sum(c[2] for c in recorder.calls if c[0] == op) for op in after.collectives
            },
            "before": before,
            "after": after,
            "units": model.num_units,
            "observer_calls": len(recorder.calls),
        }
        if prefetch:
            # Measured with gradients present (they are dropped by zero_grad).
            x, y = batch(9, 0, rank, 2)
            lm_loss(model(x), y).backward()
            out["zero3_bytes"] = live_tensor_bytes() - baseline
            del model, opt
    for bound in (1, 2, 3):
        config = ShardingConfig(unit_modules=(Block,), max_inflight_reductions=bound)
        model = _build(config)
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        _train(model, opt, range(2), rank)
        snap = model.stats.snapshot()
        out["reduce_peak"][bound] = snap.reduce_queue_depth_peak
        out["reduce_step"][bound] = (
            snap.queue_depth_step_peak["reduce"],
            snap.queue_bound["reduce"],
            snap.queue_depth_at_issue["reduce"],
        )
    model = _build(dataclasses.replace(ShardingConfig(), strategy=Strategy.NO_SHARD))
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    _train(model, opt, range(1), rank)
    x, y = batch(9, 0, rank, 2)
    lm_loss(model(x), y).backward()
    out["noshard_bytes"] = live_tensor_bytes() - baseline
    return out


def delta(after: ShardingStatsSnapshot, before: ShardingStatsSnapshot) -> tuple[int, int]:
    """(hits, misses) between two snapshots."""
    return (
        after.prefetch_hits - before.prefetch_hits,
        after.prefetch_misses - before.prefetch_misses,
    )
