"""Sharded state dicts round-trip, reshard 2 -> 4 -> 1 across strategies; full state dicts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from sharding import ShardedTensor, Strategy
from sharding._state_dict import ALIASES_KEY
from tests.sharding._ckpt_ranks import load_and_continue, save_after_training_each
from tests.sharding._helpers import Setup, make_model, merge_ranks
from tests.support.dist import run_on_ranks

WHOLE_ON_EVERY_RANK = [Strategy.NO_SHARD, Strategy.OPTIM]


@pytest.fixture(scope="module")
def two_rank_saves() -> dict[Strategy, list[dict[str, Any]]]:
    """Per strategy, every rank's `save_after_training`: one 2-rank run for all three."""
    strategies = [Strategy.OPTIM_GRADS_PARAMS, *WHOLE_ON_EVERY_RANK]
    per_rank = run_on_ranks(save_after_training_each, 2, strategies, timeout_s=240)
    return {strategy: [rank[strategy] for rank in per_rank] for strategy in strategies}


@pytest.fixture(scope="module")
def two_rank_save(
    two_rank_saves: dict[Strategy, list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    return two_rank_saves[Strategy.OPTIM_GRADS_PARAMS]


@pytest.mark.slow
def test_sharded_state_dict_round_trips(two_rank_save: list[dict[str, Any]]) -> None:
    for rank_result in two_rank_save:
        assert rank_result["again"] == rank_result["after"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", WHOLE_ON_EVERY_RANK)
def test_round_trip_restores_state_every_rank_holds_whole(
    two_rank_saves: dict[Strategy, list[dict[str, Any]]], strategy: Strategy
) -> None:
    # no_shard (and optim's model weights) are whole on every rank but saved once per element;
    # loading must complete the ranges other ranks saved (see [Note: replicated state ...]).
    for rank_result in two_rank_saves[strategy]:
        assert rank_result["again"] == rank_result["after"]


@pytest.mark.slow
def test_pieces_are_flat_and_tile_every_parameter(two_rank_save: list[dict[str, Any]]) -> None:
    models = [r["saved"]["model"] for r in two_rank_save]
    full = two_rank_save[0]["full"]
    # Tied parameters are saved once, under their first name; the rest are aliases.
    assert models[0][ALIASES_KEY] == {"head.weight": "tok_emb.weight"}
    assert set(models[0]) - {ALIASES_KEY} == set(full) - {"head.weight"}
    for key, piece in models[0].items():
        if key == ALIASES_KEY:
            continue
        assert isinstance(piece, ShardedTensor), key
        covered = sorted(m[key].flat_range for m in models)
        numel = torch.Size(piece.global_shape).numel()
        assert all(0 <= a <= b <= numel for a, b in covered), (key, covered)
        nonempty = [r for r in covered if r[1] > r[0]]
        assert nonempty[0][0] == 0, key
        assert nonempty[-1][1] == numel, key
        assert all(a[1] == b[0] for a, b in itertools.pairwise(nonempty)), key
        joined = torch.cat([m[key].local for m in sorted(models, key=lambda m: m[key].flat_range)])
        assert torch.equal(joined, full[key].reshape(-1)), key
    exp_avg = two_rank_save[0]["saved"]["optim"]["state"]["tok_emb.weight"]["exp_avg"]
    assert isinstance(exp_avg, ShardedTensor)
    assert exp_avg.flat_range is not None


@pytest.mark.slow
def test_full_state_dict_loads_into_plain_module(two_rank_save: list[dict[str, Any]]) -> None:
    rank0 = two_rank_save[0]
    assert two_rank_save[1]["full"] == {}
    plain = make_model(Setup(strategy=Strategy.NO_SHARD), seed=7)
    plain.load_state_dict(rank0["full"])
    with torch.no_grad():
        assert torch.equal(plain(rank0["probe"]), rank0["probe_out"])


@pytest.mark.slow
def test_reshard_two_to_four_to_one_across_strategies(
    two_rank_save: list[dict[str, Any]],
) -> None:
    expected_full = two_rank_save[0]["full"]
    expected_losses = two_rank_save[0]["after"]
    four = run_on_ranks(
        load_and_continue,
        4,
        Strategy.OPTIM,
        merge_ranks([r["saved"] for r in two_rank_save]),
        timeout_s=120,
    )
    one = run_on_ranks(
        load_and_continue,
        1,
        Strategy.NO_SHARD,
        merge_ranks([r["saved"] for r in four]),
        timeout_s=120,
    )
    for result in (four[0], one[0]):
        assert result["full"].keys() == expected_full.keys()
        for key, value in expected_full.items():
            assert torch.equal(result["full"][key], value), key
        for a, b in zip(result["after"], expected_losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
