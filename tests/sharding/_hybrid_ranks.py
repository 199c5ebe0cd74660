"""Rank functions of the hybrid-sharding (HSDP) tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from daemon import Block, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import Setup, batch, make_model, snapshot

STEPS = 20
"""Steps of the ZeRO-3 parity runs."""
SHORT_STEPS = 3
"""Steps of the ZeRO-1/2 hybrid runs and of the 2-rank ZeRO-3 byte-count run."""
COUNTED = (1, SHORT_STEPS)
"""Collective totals are compared over steps `[1, 3)`: after the first step, before the
final state-dict gathers."""


def _train(
    config: ShardingConfig,
    rank: int,
    world: int,
    steps: int,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    setup = Setup(strategy=config.strategy, num_layers=2)
    model = FullyShardedDataParallel(make_model(setup), config, process_group=process_group)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    losses = []
    totals: dict[int, dict[str, tuple[int, int]]] = {}
    for step in range(steps):
        if step in COUNTED:
            snap = model.stats.snapshot()
            totals[step] = {op: (t.count, t.num_bytes) for op, t in snap.collectives.items()}
        x, y = batch(step, 0, rank, 2)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    if steps == COUNTED[1]:
        snap = model.stats.snapshot()
        totals[steps] = {op: (t.count, t.num_bytes) for op, t in snap.collectives.items()}
    a, b = totals.get(COUNTED[0], {}), totals.get(COUNTED[1], {})
    return {
        "round_trip": _round_trip(model, opt, rank),
        "losses": losses,
        "collectives": {op: (b[op][0] - a[op][0], b[op][1] - a[op][1]) for op in b},
        "main_weights": [b.main_weight.clone() for b in model._engine.buckets],
        "trained_buckets": sum(b.trains for b in model._engine.buckets),
        "shape": (model.world_size, model.shard_group_size, model.num_replicas),
        "full": model.full_state_dict(),
    }


def _round_trip(model: FullyShardedDataParallel, opt: Any, rank: int) -> bool:
    """Save, train a step, load: every rank (replicas from replica 0) is back, bitwise."""
    saved = snapshot({"model": model.sharded_state_dict(), "optim": opt.sharded_state_dict()})
    weights = [b.main_weight.clone() for b in model._engine.buckets]
    moments = [opt.bucket_state(pos) for pos in range(len(opt.buckets))]
    x, y = batch(99, 0, rank, 2)
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    model.load_sharded_state_dict(saved["model"])
    opt.load_sharded_state_dict(saved["optim"])
    buckets = model._engine.buckets
    same = all(torch.equal(w, b.main_weight) for w, b in zip(weights, buckets, strict=True))
    for pos, before in enumerate(moments):
        after = opt.bucket_state(pos)
        assert before is not None
        assert after is not None
        same = same and all(torch.equal(before[k], after[k]) for k in before)
    return same


def _wrap_error(config: ShardingConfig, group: dist.ProcessGroup | None) -> str:
    """The message wrapping raises (every rank raises it before any collective)."""
    try:
        FullyShardedDataParallel(
            make_model(Setup(strategy=config.strategy)), config, process_group=group
        )
    except ValueError as err:
        return str(err)
    return "no error"


def hybrid_and_zero3(rank: int, world: int) -> dict[str, Any]:
    """On 4 ranks: HSDP 2x2 and ZeRO-3 on 4 (ZeRO-3), HSDP ZeRO-1/2 (short), and ZeRO-3 on
    each pair of ranks (what a 2-rank ZeRO-3 run communicates per rank, short)."""
    units = (Block,)
    zero3 = Strategy.OPTIM_GRADS_PARAMS
    hybrid = ShardingConfig(unit_modules=units, shard_group_size=2)
    out = {
        "hybrid": _train(hybrid, rank, world, STEPS),
        "zero3": _train(ShardingConfig(unit_modules=units), rank, world, STEPS),
    }
    for strategy in (Strategy.OPTIM, Strategy.OPTIM_GRADS):
        config = ShardingConfig(strategy=strategy, unit_modules=units, shard_group_size=2)
        out[strategy.value] = _train(config, rank, world, SHORT_STEPS)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out["errors"] = [
        _wrap_error(ShardingConfig(unit_modules=units, shard_group_size=3), None),
        _wrap_error(ShardingConfig(unit_modules=units, shard_group_size=2), pairs[rank // 2]),
    ]
    config = ShardingConfig(strategy=zero3, unit_modules=units)
    out["pair"] = _train(config, rank, world, SHORT_STEPS, process_group=pairs[rank // 2])
    return out
