"""Plain torch calls on a wrapped model, outside forward: each works correctly or raises.

Two cases run inside forward: under ZeRO-3 a unit that reads another unit's weight must
raise, whether that unit was already released or is only being prefetched.

Every case runs in its own spawned process group, so a crash (SIGSEGV on freed ZeRO-3
storage) is a failed case, not a dead test run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import Strategy
from tests.sharding._outside_forward_ranks import CASES, run_case
from tests.support.dist import run_on_ranks

# What a raised error must name: the engine API that does the job.
API_OF = {
    "state_dict": "summon_full_params",
    "parameter_norms": "summon_full_params",
    "parameter_outside_unit": "summon_full_params",
    "torch_save": "summon_full_params",
    "torch_clip_grad_norm": "optimizer.clip_grad_norm_",
    "torch_optimizer": "make_optimizer",
    "summoned_state_dict": "(must work)",
    "summoned_writeback": "(must work)",
    # Inside forward: another unit's weight (released, or still being gathered).
    "forward_reads_released_unit": "within that unit's own forward",
    "forward_reads_prefetched_unit": "within that unit's own forward",
}


def _check(case: str, outcome: tuple[Any, ...]) -> None:
    if outcome[0] == "raised":
        kind, message = outcome[1], outcome[2]
        assert kind in {"ParameterNotGatheredError", "GradientsInEngineError"}, outcome
        assert API_OF[case] in message, message
        return
    _, got, want = outcome
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key])
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5)
    else:
        assert got == want


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero3_case_works_or_raises(case: str) -> None:
    for outcome in run_on_ranks(run_case, 2, Strategy.OPTIM_GRADS_PARAMS, case, timeout_s=120):
        _check(case, outcome)


@pytest.mark.parametrize("case", ["torch_clip_grad_norm", "torch_optimizer", "parameter_norms"])
@pytest.mark.parametrize("strategy", [Strategy.NO_SHARD, Strategy.OPTIM_GRADS])
def test_other_strategies_case_works_or_raises(strategy: Strategy, case: str) -> None:
    for outcome in run_on_ranks(run_case, 2, strategy, case, timeout_s=120):
        _check(case, outcome)
