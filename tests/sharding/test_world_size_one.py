"""World size 1 against hand-written references: bf16 mixed precision, unusual call graphs."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from daemon import Block, GPTConfig
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import (
    Setup,
    engine_mixed_precision,
    mixed_precision_reference,
    single_thread,
    train_reference,
    train_sharded,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_bf16_world_size_one_matches_reference(strategy: Strategy) -> None:
    setup = Setup(strategy=strategy, param_dtype=torch.bfloat16)
    device = torch.device("cpu")
    losses, weights = engine_mixed_precision(setup, device, 6)
    ref_losses, ref_weights = mixed_precision_reference(setup, device, 6)
    assert losses == ref_losses
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


class _Twice(torch.nn.Module):
    """A model that runs one unit twice and leaves another unit unused."""

    def __init__(self) -> None:
        super().__init__()
        cfg = GPTConfig(d_model=16, num_heads=2, seq_len=8, num_layers=1)
        self.inp = torch.nn.Linear(4, 16)
        self.shared = Block(cfg)
        self.idle = Block(cfg)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.inp(x)))
        return self.out(h)


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_unit_called_twice_and_unit_unused(strategy: Strategy) -> None:
    torch.manual_seed(0)
    ref = _Twice()
    model = FullyShardedDataParallel(
        copy.deepcopy(ref), ShardingConfig(strategy=strategy, unit_modules=(Block,))
    )
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(3, 8, 4)
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == ref_loss.item()
    assert model.stats.snapshot().reduce_queue_depth == 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_under_zero3_is_exact(reentrant: bool) -> None:
    setup = Setup(
        strategy=Strategy.OPTIM_GRADS_PARAMS, checkpointing=True, reentrant=reentrant, steps=4
    )
    got = train_sharded(0, 1, setup)
    ref = train_reference(setup, 1)
    assert got["losses"] == ref["losses"]
    for name, value in ref["weights"].items():
        assert torch.equal(got["weights"][name], value), name


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.inp(x)))


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_a_state_dicts_buffers_do_not_change_with_the_next_forward(strategy: Strategy) -> None:
    # A checkpointer copies the state in the background until the next optimizer step (the
    # manager's fence), while the next forward runs: a training forward updates BatchNorm's
    # running statistics in place, so a buffer handed out as a view of the live one would be
    # copied half old, half new. Before: the state dict's running_mean moved with the forward.
    torch.manual_seed(0)
    model = FullyShardedDataParallel(_Normed(), ShardingConfig(strategy=strategy))
    model(torch.randn(16, 4)).sum().backward()
    state = model.sharded_state_dict()
    before = {k: v.clone() for k, v in state.items() if k.startswith("bn.running")}
    assert before
    model(torch.randn(16, 4) * 3 + 1)  # train mode: the running statistics move
    live = dict(model.module.named_buffers())
    for key, value in before.items():
        assert not torch.equal(live[key], value), key  # the forward did move them
        assert torch.equal(state[key], value), key  # the state dict did not
