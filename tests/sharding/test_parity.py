"""Parity of the engine with torch DDP (bitwise) and with an unsharded reference (1e-5).

Tolerances: per-step losses within 1e-5 relative; final weights within 1e-5 relative as a
whole (‖Δθ‖/‖θ‖) and elementwise within rtol = 1e-5, atol = 5e-5. The absolute term is needed
where a gradient is (nearly) zero: the attention key biases (softmax ignores a per-query
constant) and any element whose gradient cancels carry only rounding noise, which Adam
normalises into updates of order lr (1e-3).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import NoSyncMode, Strategy
from tests.sharding._helpers import (
    Setup,
    rel_err,
    train_many,
    train_many_and_ddp,
    train_reference,
)
from tests.support.dist import run_on_ranks

ALL = list(Strategy)
PLAIN = [Setup(strategy=s) for s in ALL]
HARD = [
    Setup(strategy=s, tie=False, micro_batches=4, clip=1.0, unused=True, checkpointing=True)
    for s in ALL
]
# Two parameter groups (decay / no decay with its own lr): a rank's shard spans both.
GROUPS = [Setup(strategy=s, groups=True, steps=12) for s in ALL]
GROUPS_ODD = [Setup(strategy=s, groups=True, steps=8, num_layers=2) for s in ALL]
# Reentrant checkpointing (units reduced and released inside backward) under both no_sync
# modes: gradients held whole across the window, or reduce-scattered every micro-batch.
GRADS_SHARDED = [Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS]
NO_SYNC = [
    Setup(
        strategy=s,
        micro_batches=3,
        checkpointing=True,
        reentrant=True,
        clip=1.0,
        tie=False,
        no_sync_mode=m,
        steps=8,
    )
    for s in GRADS_SHARDED
    for m in NoSyncMode
]
BF16 = Setup(
    strategy=Strategy.OPTIM_GRADS_PARAMS,
    param_dtype=torch.bfloat16,
    fixed_data=True,
    steps=15,
)


def _assert_parity(setup: Setup, world: int, got: dict[str, Any]) -> None:
    ref = train_reference(setup, world)
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs reference {b}"
    for a, b in zip(got["norms"], ref["norms"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), f"grad norm {a} vs reference {b}"
    assert got["weights"].keys() == ref["weights"].keys()
    flat_got = torch.cat([got["weights"][k].reshape(-1) for k in ref["weights"]])
    flat_ref = torch.cat([v.reshape(-1) for v in ref["weights"].values()])
    assert rel_err(flat_got, flat_ref) <= 1e-5
    # atol 5e-5 (was 1e-5): on an AVX-512 host one element of 4096 of blocks.2.fc.weight
    # ended 1.6e-5 from the reference after the reentrant no_sync runs, while the model stayed
    # within 1e-5 norm-wise; a lost or doubled gradient moves every element by about lr/step.
    for key, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=5e-5, msg=key)


DDP_STRATEGIES = [Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS]


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    """Per rank: the runs of PLAIN, HARD, BF16, GROUPS, then NO_SYNC (`runs`), and the DDP
    comparison (`ddp`): one 2-rank spawn for all."""
    setups = [*PLAIN, *HARD, BF16, *GROUPS, *NO_SYNC]
    # The three runs it replaces had 300 s, 300 s and 180 s; pytest's own limit is 600 s.
    return run_on_ranks(train_many_and_ddp, 2, setups, DDP_STRATEGIES, timeout_s=600)


@pytest.fixture(scope="module")
def two_rank_runs(two_rank_results: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per rank, the `train_many` runs of `two_rank_results`."""
    return [rank["runs"] for rank in two_rank_results]


@pytest.mark.slow
def test_bitwise_equal_to_ddp_on_two_ranks(two_rank_results: list[dict[str, Any]]) -> None:
    strategies = DDP_STRATEGIES
    for rank_result in (rank["ddp"] for rank in two_rank_results):
        assert len(rank_result["ddp"]) == 12
        for strategy in strategies:
            assert rank_result[strategy.value] == rank_result["ddp"], strategy


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ALL)), ids=[s.value for s in ALL])
def test_two_rank_parity_plain(two_rank_runs: list[list[dict[str, Any]]], index: int) -> None:
    _assert_parity(PLAIN[index], 2, two_rank_runs[0][index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ALL)), ids=[s.value for s in ALL])
def test_two_rank_parity_accumulation_clipping_unused_checkpointing(
    two_rank_runs: list[list[dict[str, Any]]], index: int
) -> None:
    _assert_parity(HARD[index], 2, two_rank_runs[0][len(PLAIN) + index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ALL)), ids=[s.value for s in ALL])
def test_two_rank_parity_two_param_groups(
    two_rank_runs: list[list[dict[str, Any]]], index: int
) -> None:
    _assert_parity(GROUPS[index], 2, two_rank_runs[0][len(PLAIN) + len(HARD) + 1 + index])


@pytest.fixture(scope="module")
def no_sync_runs(two_rank_runs: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Per rank, the NO_SYNC runs (the tail of `two_rank_runs`)."""
    return [runs[-len(NO_SYNC) :] for runs in two_rank_runs]


@pytest.mark.slow
@pytest.mark.parametrize(
    "index",
    range(len(NO_SYNC)),
    ids=[f"{s.strategy.value}-{s.no_sync_mode.value}" for s in NO_SYNC],
)
def test_two_rank_parity_reentrant_checkpointing_no_sync_modes(
    no_sync_runs: list[list[dict[str, Any]]], index: int
) -> None:
    setup, got = NO_SYNC[index], no_sync_runs[0][index]
    _assert_parity(setup, 2, got)
    # Reduce-scatters per accumulation window (one optimizer step), from the stats.
    per_window = setup.micro_batches if setup.no_sync_mode is NoSyncMode.REDUCE_SCATTER else 1
    assert got["reduce_scatters"] == [per_window * got["trained_buckets"]] * setup.steps


@pytest.mark.slow
def test_three_rank_parity_two_param_groups_every_strategy() -> None:
    # An odd world size: shards start mid-parameter and span both groups.
    results = run_on_ranks(train_many, 3, GROUPS_ODD, timeout_s=300)
    for setup, got in zip(GROUPS_ODD, results[0], strict=True):
        _assert_parity(setup, 3, got)


@pytest.mark.slow
def test_bf16_compute_trains(two_rank_runs: list[list[dict[str, Any]]]) -> None:
    losses = two_rank_runs[0][len(PLAIN) + len(HARD)]["losses"]
    assert losses[-1] < losses[0] - 0.5, losses
    ref = train_reference(BF16, 2)["losses"]
    # bf16 compute follows the fp32 reference loosely, not bitwise.
    assert abs(losses[-1] - ref[-1]) < 0.1 * ref[-1]


@pytest.mark.slow
def test_four_rank_parity_every_strategy() -> None:
    # The full acceptance mix at four ranks, kept light by a 2-layer model and batch 1.
    setups = [
        Setup(
            strategy=s,
            tie=False,
            micro_batches=4,
            clip=1.0,
            unused=True,
            checkpointing=True,
            per_rank_batch=1,
            num_layers=2,
        )
        for s in ALL
    ]
    results = run_on_ranks(train_many, 4, setups, timeout_s=300)
    for setup, got in zip(setups, results[0], strict=True):
        _assert_parity(setup, 4, got)
