"""Rank functions of the hybrid checkpoint round trip (sharding composed with ckpt_manager).

HSDP 2x2 saves -> ZeRO-3 on 4 restores and saves -> no_shard on 1 restores and saves ->
HSDP 2x2 restores: weights and optimizer state must come back bitwise. Each stage builds its
model from another seed, so only the checkpoint can carry the values. One launch of 4 ranks
runs the 4-rank stages; the test process runs the world-size-1 stage in between (the ranks
wait for its checkpoint to be committed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from daemon import Block, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import Setup, batch, make_model

STEP = 3
"""Training steps before the first save (the step every stage saves under)."""


def _wrap(strategy: Strategy, seed: int, shard_group_size: int | None = None) -> Any:
    model = FullyShardedDataParallel(
        make_model(Setup(strategy=strategy, num_layers=2), seed=seed),
        ShardingConfig(strategy=strategy, unit_modules=(Block,), shard_group_size=shard_group_size),
    )
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    return model, opt


def _step(model: Any, opt: Any, step: int, rank: int, *, zero: bool = False) -> None:
    x, y = batch(step, 0, rank, 2)
    loss = lm_loss(model(x), y)
    # A zero loss creates the optimizer state a restore template needs (the daemon's way).
    (loss * 0.0 if zero else loss).backward()
    opt.step()
    opt.zero_grad()


def _state(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.sharded_state_dict(), "optimizer": opt.sharded_state_dict()}


def _manager(root: str) -> CheckpointManager:
    return CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="hsdp")


def engine_state(model: Any, opt: Any) -> dict[str, Any]:
    """This rank's main weights and flat optimizer state per bucket (copies)."""
    return {
        "weights": [b.main_weight.clone() for b in model._engine.buckets],
        "optimizer": [opt.bucket_state(pos) for pos in range(len(opt.buckets))],
    }


def _restore_and_save(model: Any, opt: Any, rank: int, src: str, dst: str) -> None:
    _step(model, opt, 0, rank, zero=True)
    with _manager(src) as manager:
        restored = manager.restore(STEP, into=_state(model, opt))
    assert restored is not None
    model.load_sharded_state_dict(restored.state["model"])
    opt.load_sharded_state_dict(restored.state["optimizer"])
    with _manager(dst) as manager:
        manager.save(STEP, _state(model, opt))
        manager.wait_until_finished()


def committed(root: str) -> bool:
    """Whether `STEP` is committed under `root` (its manifest, written last, exists)."""
    return (Path(root) / f"step-{STEP:012d}" / "manifest.json").exists()


def no_shard_single(roots: dict[str, str]) -> None:
    """World size 1 (no process group): no_shard restores the ZeRO-3 checkpoint and saves."""
    model, opt = _wrap(Strategy.NO_SHARD, seed=2)
    _restore_and_save(model, opt, 0, roots["zero3"], roots["no_shard"])


def round_trip(rank: int, world: int, roots: dict[str, str], wait_s: float) -> dict[str, Any]:
    """4 ranks: HSDP 2x2 trains and saves; ZeRO-3 on 4 restores it and saves; then, once the
    test process (world size 1, `no_shard_single`) has saved the no_shard checkpoint, HSDP
    2x2 restores that. Returns this rank's engine state as saved and as restored."""
    model, opt = _wrap(Strategy.OPTIM_GRADS_PARAMS, seed=0, shard_group_size=2)
    for step in range(STEP):
        _step(model, opt, step, rank)
    with _manager(roots["hybrid"]) as manager:
        manager.save(STEP, _state(model, opt))
        manager.wait_until_finished()
    saved = engine_state(model, opt)
    zero3, zero3_opt = _wrap(Strategy.OPTIM_GRADS_PARAMS, seed=1)
    _restore_and_save(zero3, zero3_opt, rank, roots["hybrid"], roots["zero3"])
    deadline = time.monotonic() + wait_s
    while not committed(roots["no_shard"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no no_shard checkpoint under {roots['no_shard']} in {wait_s} s")
        time.sleep(0.1)
    model, opt = _wrap(Strategy.OPTIM_GRADS_PARAMS, seed=3, shard_group_size=2)
    _step(model, opt, 0, rank, zero=True)
    with _manager(roots["no_shard"]) as manager:
        restored = manager.restore(STEP, into=_state(model, opt))
    assert restored is not None
    model.load_sharded_state_dict(restored.state["model"])
    opt.load_sharded_state_dict(restored.state["optimizer"])
    return {"saved": saved, "back": engine_state(model, opt)}
