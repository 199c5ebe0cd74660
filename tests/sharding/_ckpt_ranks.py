"""Rank functions of the state-dict tests: save, reshard, reload, continue."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from daemon import lm_loss
from sharding import Strategy
from tests.sharding._helpers import (
    Setup,
    global_batch,
    make_model,
    param_groups,
    snapshot,
    wrap,
)

GLOBAL_BATCH = 4


def _step(model: Any, opt: Any, step: int, rank: int, world: int) -> float:
    x, y = global_batch(step, 0, 1, GLOBAL_BATCH)
    per = GLOBAL_BATCH // world
    loss = lm_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach().clone()
    if world > 1:
        dist.all_reduce(value)
    return float(value) / world


def save_after_training(rank: int, world: int, strategy: Strategy) -> dict[str, Any]:
    """Train 3 steps, save, train 2 more; also check an in-place round trip (two groups)."""
    setup = Setup(strategy=strategy, groups=True)
    model = wrap(make_model(setup), setup)
    opt = model.make_optimizer(
        torch.optim.AdamW, param_groups(model, setup), lr=1e-3, weight_decay=0.1
    )
    for step in range(3):
        _step(model, opt, step, rank, world)
    saved = snapshot({"model": model.sharded_state_dict(), "optim": opt.sharded_state_dict()})
    full = model.full_state_dict()
    probe = global_batch(99, 0, 1, 2)[0]
    with torch.no_grad():
        probe_out = model(probe)
    after = [_step(model, opt, step, rank, world) for step in (3, 4)]
    model.load_sharded_state_dict(saved["model"])
    opt.load_sharded_state_dict(saved["optim"])
    again = [_step(model, opt, step, rank, world) for step in (3, 4)]
    return {
        "saved": saved,
        "full": full,
        "probe": probe,
        "probe_out": probe_out,
        "after": after,
        "again": again,
    }


def save_after_training_each(
    rank: int, world: int, strategies: list[Strategy]
) -> dict[Strategy, dict[str, Any]]:
    """`save_after_training` per strategy, one after another in this process group."""
    return {strategy: save_after_training(rank, world, strategy) for strategy in strategies}


def load_and_continue(
    rank: int, world: int, strategy: Strategy, merged: dict[str, Any]
) -> dict[str, Any]:
    """Load pieces saved at another world size/strategy, save again, train steps 3 and 4."""
    setup = dataclasses.replace(Setup(strategy=strategy, groups=True))
    model = wrap(make_model(setup, seed=123), setup)
    # Other hyperparameters than saved: loading must restore each group's own.
    opt = model.make_optimizer(
        torch.optim.AdamW, param_groups(model, setup), lr=5e-2, weight_decay=0.5
    )
    model.load_sharded_state_dict(merged["model"])
    opt.load_sharded_state_dict(merged["optim"])
    saved = snapshot({"model": model.sharded_state_dict(), "optim": opt.sharded_state_dict()})
    full = model.full_state_dict()
    after = [_step(model, opt, step, rank, world) for step in (3, 4)]
    return {"saved": saved, "full": full, "after": after}
