"""Plain torch calls on a wrapped model, outside forward: each works correctly or raises.

Two cases run inside forward: under ZeRO-3 a unit that reads another unit's weight must
raise, whether that unit was already released or is only being prefetched.

All cases run one after another in one spawned 2-rank process group (each on its own freshly
wrapped model), so a crash (SIGSEGV on freed ZeRO-3 storage) fails the cases, not the test
run; each case is still its own test, reading its outcome from that one run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import Strategy
from tests.sharding._outside_forward_ranks import CASES, run_cases
from tests.support.dist import run_on_ranks

ZERO3_CASES = sorted(CASES)
OTHER_STRATEGIES = [Strategy.NO_SHARD, Strategy.OPTIM_GRADS]
OTHER_CASES = ["torch_clip_grad_norm", "torch_optimizer", "parameter_norms"]
PAIRS = [(Strategy.OPTIM_GRADS_PARAMS, case) for case in ZERO3_CASES] + [
    (strategy, case) for strategy in OTHER_STRATEGIES for case in OTHER_CASES
]
"""Every (strategy, case) the tests check, in the order the ranks run them."""

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


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[Strategy, str], list[tuple[Any, ...]]]:
    """Per (strategy, case): every rank's outcome, from one run of all cases."""
    per_rank = run_on_ranks(run_cases, 2, PAIRS, timeout_s=300)
    return {pair: [rank[i] for rank in per_rank] for i, pair in enumerate(PAIRS)}


@pytest.mark.parametrize("case", ZERO3_CASES)
def test_zero3_case_works_or_raises(
    outcomes: dict[tuple[Strategy, str], list[tuple[Any, ...]]], case: str
) -> None:
    for outcome in outcomes[Strategy.OPTIM_GRADS_PARAMS, case]:
        _check(case, outcome)


@pytest.mark.parametrize("case", OTHER_CASES)
@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
def test_other_strategies_case_works_or_raises(
    outcomes: dict[tuple[Strategy, str], list[tuple[Any, ...]]], strategy: Strategy, case: str
) -> None:
    for outcome in outcomes[strategy, case]:
        _check(case, outcome)
