"""A unit whose output is the wrapper's output: its weights are back before its backward runs.

Under ZeRO-3 the last unit of a `Sequential` returns the tensor the wrapper returns. Its
pre-backward hook was registered on that tensor before the wrapper's own, so it fires first,
while the engine still thinks no backward has begun. It used to be skipped there: the unit's
backward then read weights that the wrapper's hook had only started gathering (a version
error in autograd when the gather finished first, stale memory when it did not) or, without
prefetch, released storage. Seen flaky in CI (tests/daemon/test_fsdp2_interop.py, about one
run in 20 here); the user hook below, which lets the gather finish before the unit's backward,
made it fail every time before the fix.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 3))


def _inputs() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(2, 4)


def train_two_steps(rank: int, world: int, prefetch: bool) -> dict[str, torch.Tensor] | None:
    """Two SGD steps on the same batch on every rank; rank 0 returns the full weights."""
    engine = FullyShardedDataParallel(
        _model(),
        ShardingConfig(
            strategy=Strategy.OPTIM_GRADS_PARAMS,
            unit_modules=(torch.nn.Linear,),
            param_dtype=torch.float32,
            prefetch=prefetch,
        ),
    )
    opt = engine.make_optimizer(torch.optim.SGD, lr=0.5)
    for _ in range(2):
        out = engine(_inputs())
        # Runs after the engine's hooks on this tensor and before the last unit's backward:
        # time for any gather they issued to land.
        out.register_hook(lambda grad: (time.sleep(0.2), grad)[1])
        out.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    full = engine.full_state_dict()
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_last_unit_output_is_the_wrapper_output(prefetch: bool) -> None:
    got: Any = run_on_ranks(train_two_steps, 2, prefetch, timeout_s=120)[0]
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        reference(_inputs()).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    want = reference.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)
