"""Rank functions of the outside-forward matrix: plain torch calls on a wrapped model.

Each case trains one step, then makes one torch call that bypasses the engine's API. It
returns `("raised", error type, message)` or `("value", what the call produced, the truth)`
so the test can demand: raised a `ShardingError` naming the engine's API, or was right.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
import torch.distributed as dist

from daemon import lm_loss
from sharding import Strategy
from tests.sharding._helpers import Setup, batch, make_model, wrap


def _forward_backward(model: Any, rank: int) -> None:
    x, y = batch(0, 0, rank, 2)
    lm_loss(model(x), y).backward()


def _full_weights(model: Any) -> dict[str, torch.Tensor]:
    """The real weights, on every rank (collective)."""
    box = [_weights(model.full_state_dict())]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _weights(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _state_dict(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    got = _weights(model.state_dict())
    return {k.removeprefix("module."): v for k, v in got.items()}, truth


def _norms(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    got = math.sqrt(sum(float(p.norm()) ** 2 for p in model.parameters()))
    seen = {id(p) for p in model.module.parameters()}
    assert seen
    names = [n for n, _ in model.module.named_parameters()]
    want = math.sqrt(sum(float(truth[n].norm()) ** 2 for n in names))
    return got, want


def _outside_unit(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    name, param = next(iter(model.module.blocks[0].named_parameters()))
    return float((param * 2).sum()), float((truth[f"blocks.0.{name}"] * 2).sum())


def _torch_save(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    return {k.removeprefix("module."): v for k, v in _weights(loaded).items()}, truth


def _torch_clip(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    opt = model.make_optimizer(torch.optim.SGD, lr=0.0)
    _forward_backward(model, rank)
    got = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    want = float(opt.clip_grad_norm_(math.inf))
    return got, want


def _torch_optimizer(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _forward_backward(model, rank)
    opt.step()
    after = _full_weights(model)
    changed = any(not torch.equal(after[k], truth[k]) for k in truth)
    return changed, True


def _summoned_state_dict(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    with model.summon_full_params():
        got = _weights(model.state_dict())
    return {k.removeprefix("module."): v for k, v in got.items()}, truth


def _summoned_writeback(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    with model.summon_full_params(writeback=True), torch.no_grad():
        model.module.blocks[0].ln1.weight.fill_(3.0)
    after = _full_weights(model)
    want = dict(truth)
    want["blocks.0.ln1.weight"] = torch.full_like(truth["blocks.0.ln1.weight"], 3.0)
    return after, want


def _forward_reads(model: Any, rank: int, reader: int, owner: int) -> Any:
    """Forward in which unit `reader` adds a weight of unit `owner` (a different unit)."""
    blocks = model.module.blocks
    other = blocks[owner].ln1.weight

    def add_other(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + other

    blocks[reader].ln1.register_forward_hook(add_other)
    _forward_backward(model, rank)
    return None, "a ParameterNotGatheredError"


def _reads_released_unit(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    # Block 0 ran and was released before block 1 runs.
    return _forward_reads(model, rank, reader=1, owner=0)


def _reads_prefetched_unit(model: Any, rank: int, truth: dict[str, torch.Tensor]) -> Any:
    # Block 1 is prefetched (its gather issued, not waited on) while block 0 runs.
    return _forward_reads(model, rank, reader=0, owner=1)


CASES = {
    "state_dict": _state_dict,
    "parameter_norms": _norms,
    "parameter_outside_unit": _outside_unit,
    "torch_save": _torch_save,
    "torch_clip_grad_norm": _torch_clip,
    "torch_optimizer": _torch_optimizer,
    "summoned_state_dict": _summoned_state_dict,
    "summoned_writeback": _summoned_writeback,
    "forward_reads_released_unit": _reads_released_unit,
    "forward_reads_prefetched_unit": _reads_prefetched_unit,
}


def run_case(rank: int, world: int, strategy: Strategy, case: str) -> tuple[Any, ...]:
    """Train one step with the engine, then run `case`; report what happened."""
    setup = Setup(strategy=strategy)
    model = wrap(make_model(setup), setup)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
    _forward_backward(model, rank)
    opt.step()
    opt.zero_grad()
    truth = _full_weights(model)  # collective, before anything can fail
    try:
        got, want = CASES[case](model, rank, truth)
    except Exception as err:
        return ("raised", type(err).__name__, str(err))
    return ("value", got, want)


def run_cases(rank: int, world: int, pairs: list[tuple[Strategy, str]]) -> list[tuple[Any, ...]]:
    """`run_case` for each (strategy, case) in order, in this one process group.

    Each case builds its own model, so one case's outcome cannot change another's; a crash
    ends only these rank processes (every case then fails with the rank's exit code).
    """
    outcomes = []
    for strategy, case in pairs:
        outcomes.append(run_case(rank, world, strategy, case))
        # Both ranks finish a case before either starts the next.
        dist.barrier()
    return outcomes
