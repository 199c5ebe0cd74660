"""Optimizer state made without a step, and a restore that fills it in place.

[Note: optimizer state made for a restore] in `sharding/_optimizer_state.py`:
`materialize_state()` must give every chunk the entries a training step gives (keys, shapes,
dtypes) with a fresh state's values (what a zero step at learning rate 0 leaves), move no
weight and draw no RNG; the template's pieces are views of that state; and a load of those
very pieces, filled in place as `restore(into=...)` fills them, keeps the state where it is
and gives exactly the saved optimizer: the next step matches the trained run bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import Strategy
from sharding._optimizer_state import _zero_step
from sharding.errors import ShardingError
from tests.sharding._ckpt_ranks import _step
from tests.sharding._helpers import Setup, make_model, param_groups, state_layout, wrap
from tests.support.dist import run_on_ranks

STRATEGIES = [Strategy.NO_SHARD, Strategy.OPTIM, Strategy.OPTIM_GRADS_PARAMS]
_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "initial_accumulator_value": 0.1}),
}


def _model_and_optimizer(strategy: Strategy, name: str) -> tuple[Any, Any]:
    from sharding import _optimizer

    _optimizer.CHUNK_NUMEL = 100  # most parameters span several chunks
    torch.manual_seed(0)
    setup = Setup(strategy=strategy, groups=True)
    model = wrap(make_model(setup), setup)
    cls, hyper = _OPTIMIZERS[name]
    return model, model.make_optimizer(cls, param_groups(model, setup), **hyper)


def _bucket_states(opt: Any) -> list[dict[str, torch.Tensor]]:
    """Every bucket's whole optimizer state on this rank (copies)."""
    return [opt.bucket_state(pos) for pos in range(len(opt.buckets))]


def _state_storages(opt: Any) -> set[int]:
    return {
        v.untyped_storage().data_ptr()
        for s in opt.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }


def _weights(model: Any, opt: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]] + [
        v.local.clone() for v in model.sharded_state_dict().values() if hasattr(v, "local")
    ]


def _fill_in_place(template: Any, saved: Any) -> None:
    """What `restore(into=template)` does: copy each saved leaf into the template's own."""
    if isinstance(template, dict):
        for key, value in template.items():
            _fill_in_place(value, saved[key])
    elif isinstance(template, list | tuple):
        for value, other in zip(template, saved, strict=True):
            _fill_in_place(value, other)
    elif hasattr(template, "local"):
        template.local.copy_(saved.local)
    elif isinstance(template, torch.Tensor):
        template.copy_(saved)


def _copied(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _copied(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_copied(v) for v in state)
    if hasattr(state, "local"):
        return type(state)(
            local=state.local.clone(),
            global_shape=state.global_shape,
            global_offset=state.global_offset,
            flat_range=state.flat_range,
        )
    return state.clone() if isinstance(state, torch.Tensor) else state


def _materialize_and_restore(rank: int, world: int, name: str) -> list[dict[str, Any]]:
    out = []
    for strategy in STRATEGIES:
        trained, trained_opt = _model_and_optimizer(strategy, name)
        for step in range(2):
            _step(trained, trained_opt, step, rank, world)
        saved = _copied(trained_opt.sharded_state_dict())

        _, zeroed_opt = _model_and_optimizer(strategy, name)
        if name != "adagrad":  # Adagrad's fresh state is the one it makes when built
            _zero_step(zeroed_opt.optimizer, zeroed_opt.params)

        model, opt = _model_and_optimizer(strategy, name)
        weights, rng = _weights(model, opt), torch.get_rng_state()
        opt.materialize_state()
        template = opt.sharded_state_dict()
        storages = _state_storages(opt)
        pieces = [
            p
            for entry in template["state"].values()
            for p in entry.values()
            if hasattr(p, "local") and p.local.numel() > 0
        ]
        # SGD's momentum after a zero step is weight decay x weight (the groups decay): a
        # fresh buffer is the probe's, zeros, as SGD's first step would start from.
        fresh = all(
            torch.equal(a[k], torch.zeros_like(a[k]) if name == "sgd" else b[k])
            for a, b in zip(_bucket_states(opt), _bucket_states(zeroed_opt), strict=True)
            for k in a
        )
        row: dict[str, Any] = {
            "layout": state_layout(template) == state_layout(saved),
            "fresh": fresh,
            "views": all(p.local.untyped_storage().data_ptr() in storages for p in pieces),
            "pieces": len(pieces),
            "weights_kept": all(
                torch.equal(a, b) for a, b in zip(_weights(model, opt), weights, strict=True)
            ),
            "rng_kept": torch.equal(torch.get_rng_state(), rng),
        }
        _fill_in_place(template, saved)
        opt.load_sharded_state_dict(template)
        row["kept_in_place"] = _state_storages(opt) == storages
        row["equal"] = all(
            torch.equal(a[k], b[k])
            for a, b in zip(_bucket_states(opt), _bucket_states(trained_opt), strict=True)
            for k in a
        )
        model.load_sharded_state_dict(_copied(trained.sharded_state_dict()))
        _step(trained, trained_opt, 2, rank, world)
        _step(model, opt, 2, rank, world)
        row["next_step_equal"] = all(
            torch.equal(a, b)
            for a, b in zip(_weights(model, opt), _weights(trained, trained_opt), strict=True)
        ) and all(
            torch.equal(a[k], b[k])
            for a, b in zip(_bucket_states(opt), _bucket_states(trained_opt), strict=True)
            for k in a
        )
        out.append(row)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_state_made_without_a_step_is_restored_in_place(name: str) -> None:
    per_rank = run_on_ranks(_materialize_and_restore, 2, name, timeout_s=240)
    for rank, rows in enumerate(per_rank):
        for strategy, row in zip(STRATEGIES, rows, strict=True):
            assert row["pieces"] > 0, (rank, strategy)
            assert row == {
                "layout": True,
                "fresh": True,
                "views": True,
                "pieces": row["pieces"],
                "weights_kept": True,
                "rng_kept": True,
                "kept_in_place": True,
                "equal": True,
                "next_step_equal": True,
            }, (rank, strategy, name)


class _NormTracking(torch.optim.Optimizer):
    """SGD that keeps one non-elementwise entry per parameter (its gradient norm so far)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        del closure
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["norm"] = torch.zeros(1, dtype=p.dtype)
                state["norm"] += p.grad.norm()
                p.add_(p.grad, alpha=-group["lr"])


def test_state_that_is_not_elementwise_is_made_by_a_zero_step() -> None:
    torch.manual_seed(0)
    setup = Setup(strategy=Strategy.NO_SHARD)
    model = wrap(make_model(setup), setup)
    opt = model.make_optimizer(_NormTracking, lr=0.1)
    weights = _weights(model, opt)
    opt.materialize_state()
    states = [opt.optimizer.state[p] for p in opt.params]
    assert states
    assert all(list(s) == ["norm"] for s in states)
    assert all(torch.equal(s["norm"], torch.zeros(1)) for s in states)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model, opt), weights, strict=True))
    assert [g["lr"] for g in opt.param_groups] == [0.1]


def test_materialize_leaves_a_state_it_finds_and_refuses_a_partial_one() -> None:
    torch.manual_seed(0)
    setup = Setup(strategy=Strategy.NO_SHARD)
    model = wrap(make_model(setup), setup)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    assert opt.materialize_state() is True
    state = {id(p): dict(opt.optimizer.state[p]) for p in opt.params}
    assert opt.materialize_state() is False  # nothing changed
    assert all(v is state[id(p)][k] for p in opt.params for k, v in opt.optimizer.state[p].items())
    del opt.optimizer.state[opt.params[-1]]
    with pytest.raises(ShardingError, match="others none"):
        opt.materialize_state()
    opt.optimizer.state.clear()
    assert opt.materialize_state() is True  # a cleared optimizer is fresh again
    # Adagrad makes its state when built: there is nothing to make.
    adagrad = model.make_optimizer(torch.optim.Adagrad, lr=1e-2)
    assert adagrad.materialize_state() is False


def test_groups_with_different_state_entries_are_refused() -> None:
    # [Note: one set of state entries per optimizer]: AdamW's amsgrad in one group only left
    # that group's `max_exp_avg_sq` out of the state dict (a bucket holds both groups' chunks
    # and its first chunk's entries were taken for all): refused with the groups named.
    setup = Setup(strategy=Strategy.NO_SHARD, groups=True)
    model = wrap(make_model(setup), setup)
    groups = param_groups(model, setup)
    assert groups is not None
    mixed = [{**groups[0], "amsgrad": True}, groups[1]]
    with pytest.raises(ShardingError, match=r"max_exp_avg_sq.*amsgrad"):
        model.make_optimizer(torch.optim.AdamW, mixed, lr=1e-3)
    # The same option in every group: each parameter's state has every entry.
    same = [{**g, "amsgrad": True} for g in groups]
    opt = model.make_optimizer(torch.optim.AdamW, same, lr=1e-3)
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens).float().mean().backward()
    opt.step()
    state = opt.sharded_state_dict()["state"]
    assert state
    assert all("max_exp_avg_sq" in entry for entry in state.values())
