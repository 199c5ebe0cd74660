"""Rank function of the deferred weight-gather tests: who waits on a step's all-gathers.

Each rank trains the wrapped model and, in the same process, an unwrapped reference on the
global batch, and reads the wrapped model's weights right after `step()` in several ways
(the stats say which reader waited on which gather), comparing every read with the
reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from daemon import lm_loss
from sharding import FullyShardedDataParallel, Strategy
from tests.sharding._helpers import Setup, batch, global_batch, make_model, single_thread, wrap

_LR = 1e-3
_WD = 0.1


class _Pair:
    """The wrapped model and the unwrapped reference, stepped together."""

    def __init__(self, strategy: Strategy, rank: int, world: int) -> None:
        setup = Setup(strategy=strategy, num_layers=3)
        self.rank, self.world = rank, world
        self.model = wrap(make_model(setup), setup)
        self.opt = self.model.make_optimizer(torch.optim.AdamW, lr=_LR, weight_decay=_WD)
        self.ref = make_model(setup)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), lr=_LR, weight_decay=_WD)

    def backward(self, step: int) -> None:
        x, y = batch(step, 0, self.rank, 2)
        lm_loss(self.model(x), y).backward()
        gx, gy = global_batch(step, 0, self.world, 2)
        with single_thread():
            lm_loss(self.ref(gx), gy).backward()

    def step(self, *, zero: bool = True) -> None:
        self.opt.step()
        with single_thread():
            self.ref_opt.step()
        if zero:
            self.opt.zero_grad()
            self.ref_opt.zero_grad()

    def pending(self) -> int:
        return self.model.stats.snapshot().weight_gathers_pending

    def ref_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.ref.state_dict().items()}


def _state_dict(model: FullyShardedDataParallel) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}


def _unit_of(model: FullyShardedDataParallel, prefix: str) -> int:
    return model.unit_names.index(prefix)


def deferred_gathers(rank: int, world: int, strategy: Strategy) -> dict[str, Any]:
    """Pending counts and reads after `step()`; every read paired with the reference's value."""
    pair = _Pair(strategy, rank, world)
    model, engine = pair.model, pair.model._engine
    out: dict[str, Any] = {
        "num_buckets": len(engine.buckets),
        "root_buckets": len(engine.unit_buckets[engine.root]),
        "block0_buckets": len(engine.unit_buckets[_unit_of(model, "blocks.0")]),
    }

    # 1. `model.state_dict()` right after the step.
    pair.backward(0)
    pair.step()
    out["pending_after_step"] = pair.pending()
    out["state_dict"] = (_state_dict(model), pair.ref_weights())
    out["pending_after_state_dict"] = pair.pending()

    # 2. One parameter read right after the step waits for its own bucket only.
    pair.backward(1)
    pair.step()
    name = "blocks.2.fc.weight"
    before = pair.pending()
    got = dict(model.module.named_parameters())[name].detach().clone()
    out["param_read"] = (got, pair.ref_weights()[name])
    out["pending_around_param_read"] = (before, pair.pending())

    # 3. An eval forward waits unit by unit; a hook in block 0 sees the later units still
    #    pending, and reading block 2's weight there (before block 2 runs) waits for it.
    pair.backward(2)
    pair.step()
    seen: dict[str, Any] = {}
    block2_weight = dict(model.module.named_parameters())[name]

    def in_block0(module: nn.Module, args: Any) -> None:
        seen["pending_in_block0"] = pair.pending()
        seen["early_read"] = block2_weight.detach().clone()
        seen["pending_after_early_read"] = pair.pending()

    truth = pair.ref_weights()[name]
    handle = model.module.blocks[0].register_forward_pre_hook(in_block0)
    waited_before = model.stats.snapshot().weight_gathers_waited_in_forward
    with torch.no_grad():
        model(batch(99, 0, rank, 2)[0])
    handle.remove()
    out["eval_forward"] = {
        **seen,
        "early_read_truth": truth,
        "pending_after": pair.pending(),
        "waited_in_forward": model.stats.snapshot().weight_gathers_waited_in_forward
        - waited_before,
    }

    # 4. Two steps with no forward between them: the second waits before it writes.
    pair.backward(3)
    pair.step(zero=False)
    elsewhere = model.stats.snapshot().weight_gathers_waited_elsewhere
    pair.step()
    out["double_step_waits"] = (
        model.stats.snapshot().weight_gathers_waited_elsewhere - elsewhere,
        pair.pending(),
    )
    out["double_step"] = (_state_dict(model), pair.ref_weights())

    # 5. Training forwards after the steps: every gather is waited in forward.
    in_forward_before = model.stats.snapshot().weight_gathers_waited_in_forward
    elsewhere_before = model.stats.snapshot().weight_gathers_waited_elsewhere
    for step in range(4, 7):
        pair.backward(step)
        pair.step()
    snap = model.stats.snapshot()
    out["training"] = {
        "in_forward": snap.weight_gathers_waited_in_forward - in_forward_before,
        "elsewhere": snap.weight_gathers_waited_elsewhere - elsewhere_before,
        "pending": snap.weight_gathers_pending,
    }
    out["final"] = ({k: v.clone() for k, v in model.full_state_dict().items()}, pair.ref_weights())
    return out
