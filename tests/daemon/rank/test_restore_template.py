"""The restore template's optimizer state ([Note: the restore template needs optimizer state]).

`_materialize_optimizer_state` must give the optimizer exactly the state a training step gives
it (same entries, shapes, dtypes), for every sharding strategy, without moving a weight,
drawing from the RNG or running a forward: a restore fills only the template's leaves.
"""

from __future__ import annotations

import pytest
import torch

from daemon import GPT, Block, GPTConfig
from daemon.rank.batch import forward_loss
from daemon.rank.loop import _forget_optimizer_state, _materialize_optimizer_state, make_optimizer
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import state_layout


def _wrapped(strategy: Strategy) -> tuple[FullyShardedDataParallel, object]:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(d_model=16, num_layers=2, num_heads=2, seq_len=8))
    model = FullyShardedDataParallel(gpt, ShardingConfig(strategy=strategy, unit_modules=(Block,)))
    return model, make_optimizer(model, lr=1e-2, weight_decay=0.1)


def _weights(model: FullyShardedDataParallel, optimizer: object) -> dict[str, torch.Tensor]:
    """Copies of the model's (local pieces of) weights and the optimizer's main weights."""
    out = dict(_tensors(model.sharded_state_dict(), "model"))
    params = [p for g in optimizer.param_groups for p in g["params"]]  # type: ignore[attr-defined]
    out.update({f"main.{i}": p.detach().clone() for i, p in enumerate(params)})
    return out


def _tensors(state: object, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(state, dict):
        return [t for k, v in state.items() for t in _tensors(v, f"{path}.{k}")]
    if isinstance(state, list | tuple):
        return [t for i, v in enumerate(state) for t in _tensors(v, f"{path}.{i}")]
    local = getattr(state, "local", state)
    return [(path, local.detach().clone())] if isinstance(local, torch.Tensor) else []


@pytest.mark.parametrize("strategy", list(Strategy))
def test_template_state_is_a_training_steps_without_moving_a_weight(strategy: Strategy) -> None:
    trained, trained_opt = _wrapped(strategy)
    tokens = torch.randint(0, 256, (2, 9))
    loss = forward_loss(trained, _lm_loss, (tokens[:, :-1], tokens[:, 1:]))
    loss.backward()  # type: ignore[no-untyped-call]
    trained_opt.step()  # type: ignore[attr-defined]
    trained_opt.zero_grad()  # type: ignore[attr-defined]

    model, optimizer = _wrapped(strategy)
    weights = _weights(model, optimizer)
    rng = torch.get_rng_state()
    _materialize_optimizer_state(optimizer)

    template = optimizer.sharded_state_dict()  # type: ignore[attr-defined]
    assert template["state"], "no optimizer state: a restore would fill none"
    assert state_layout(template, skip=("step",)) == state_layout(
        trained_opt.sharded_state_dict(),  # type: ignore[attr-defined]
        skip=("step",),
    )
    for name, value in _weights(model, optimizer).items():
        assert torch.equal(value, weights[name]), name
        assert value.signbit().equal(weights[name].signbit()), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 1e-2]  # type: ignore[attr-defined]
    assert all(p.grad is None for g in optimizer.param_groups for p in g["params"])  # type: ignore[attr-defined]

    _forget_optimizer_state(optimizer)
    assert not optimizer.sharded_state_dict()["state"]  # type: ignore[attr-defined]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
