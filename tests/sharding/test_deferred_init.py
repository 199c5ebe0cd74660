"""Deferred init: a model built on the meta device is materialized unit by unit at wrap.

See [Note: deferred init] in `sharding/_materialize.py`. World size 1 runs in-process; one
4-rank launch (`_deferred_init_ranks.py`; its two pairs of ranks give world size 2) does the
multi-rank checks: the
peak resident memory of a ZeRO-3 wrap at 4 ranks, the full weights bitwise equal at world
sizes 1, 2 and 4 under every strategy, and training from them equal to a single-process
run (the parity tolerance of test_parity.py); the shared-fc model also checks parameters
tied across units.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from daemon import GPT, Block, lm_loss
from sharding import DeferredInit, FullyShardedDataParallel, ShardingConfig, Strategy
from sharding.errors import DeferredInitError
from tests.sharding._deferred_init_ranks import (
    BIG,
    LR,
    SMALL,
    STEPS,
    TIED_STEPS,
    WD,
    SharedFcModel,
    deferred_init_checks,
    digests,
    meta_gpt,
    wrap_meta,
)
from tests.sharding._helpers import global_batch, single_thread
from tests.support.dist import run_on_ranks


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("measures VmHWM through /proc and glibc's mallopt")
    return run_on_ranks(deferred_init_checks, 4, timeout_s=300)


@pytest.fixture(scope="module")
def four(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """World size 4 (rank 0's results)."""
    return ranks[0]


@pytest.fixture(scope="module")
def two(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """World size 2: pair {0, 1}'s results (pair {2, 3} ran the same and must agree)."""
    first, second = ranks[0]["two"], ranks[2]["two"]
    assert digests(first["tied_initial"]) == digests(second["tied_initial"])
    assert {k: v for k, v in first.items() if k != "tied_initial"} == {
        k: v for k, v in second.items() if k != "tied_initial"
    }
    return first


@pytest.fixture(scope="module")
def big_one() -> dict[str, str]:
    """The big GPT's weights at world size 1 (ZeRO-3, no process group)."""
    return digests(wrap_meta(meta_gpt(BIG), Strategy.OPTIM_GRADS_PARAMS).full_state_dict())


def _reference_losses(
    model: nn.Module, weights: dict[str, torch.Tensor], steps: int
) -> list[float]:
    """Train an unwrapped model from `weights` on the global batch of 4 ranks."""
    model.load_state_dict(weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    with single_thread():
        for step in range(steps):
            x, y = global_batch(step, 0, 4, 2)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return losses


# ---- 4 ranks, ZeRO-3 -------------------------------------------------------------------------


@pytest.mark.slow
def test_wrap_peak_is_the_shards_plus_one_unit(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        rank = result["memory"]
        assert rank["whole"] >= 8 * rank["largest_unit"], "the model must dwarf its units"
        bound = 1.25 * (rank["sharded"] + rank["largest_unit"])
        # Materializing the whole model breaks the bound by more than two units.
        assert rank["whole"] > bound + 2 * rank["largest_unit"]
        assert rank["peak"] <= bound, (rank["peak"], bound, rank["sharded"])


@pytest.mark.slow
def test_full_weights_are_bitwise_equal_at_world_sizes_1_2_4(
    four: dict[str, Any], two: dict[str, Any], big_one: dict[str, str]
) -> None:
    assert four["big"] == two["big"] == big_one
    assert big_one["blocks.0.fc.weight"] != big_one["blocks.1.fc.weight"]


@pytest.mark.slow
def test_every_strategy_gives_the_same_weights(two: dict[str, Any]) -> None:
    one = digests(wrap_meta(meta_gpt(SMALL), Strategy.NO_SHARD).full_state_dict())
    for strategy in Strategy:
        assert two[strategy.value] == one, strategy


@pytest.mark.slow
def test_training_matches_a_single_process_run_from_the_same_weights(
    four: dict[str, Any],
) -> None:
    weights = four["small_initial"]
    assert digests(weights) == digests(
        wrap_meta(meta_gpt(SMALL), Strategy.OPTIM_GRADS_PARAMS).full_state_dict()
    )
    want = _reference_losses(GPT(SMALL), weights, STEPS)
    torch.testing.assert_close(four["losses"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_parameters_tied_across_units_train_as_unsharded(two: dict[str, Any]) -> None:
    """`fc` of every block is block 0's: it lives in the root unit; default init."""
    with torch.device("meta"):
        model = SharedFcModel()
    one = wrap_meta(model, Strategy.OPTIM_GRADS_PARAMS).full_state_dict()
    assert digests(two["tied_initial"]) == digests(one)
    # Only the 2-rank losses are checked here, against a 2-rank global batch.
    ref = SharedFcModel()
    ref.load_state_dict(two["tied_initial"])
    assert ref.blocks[2].fc.weight is ref.blocks[0].fc.weight  # type: ignore[union-attr]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    want = []
    with single_thread():
        for step in range(TIED_STEPS):
            x, y = global_batch(step, 0, 2, 2)
            loss = lm_loss(ref(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(float(loss.detach()))
    torch.testing.assert_close(two["tied_losses"], want, rtol=1e-5, atol=1e-5)


# ---- world size 1, in-process ------------------------------------------------------------------


def test_init_is_seeded_per_module_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    seen: list[str] = []

    def init_fn(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            p.normal_()

    model = meta_gpt(SMALL)
    wrapped = FullyShardedDataParallel(
        model, ShardingConfig(deferred_init=DeferredInit(seed=3, init_fn=init_fn))
    )
    assert torch.equal(torch.get_rng_state(), before)
    # Once per module holding tensors: 2 embeddings, 6 per block (2 norms, 4 linears), ln_f, head.
    assert len(seen) == 2 + SMALL.num_layers * 6 + 2
    first = wrapped.full_state_dict()
    reset = wrap_meta(meta_gpt(SMALL), Strategy.NO_SHARD, init=False).full_state_dict()
    other = FullyShardedDataParallel(
        meta_gpt(SMALL), ShardingConfig(deferred_init=DeferredInit(seed=4, init_fn=init_fn))
    ).full_state_dict()
    assert not torch.equal(first["blocks.0.fc.weight"], other["blocks.0.fc.weight"])
    # Same seed, other init: reset_parameters() (LayerNorm weights are ones either way).
    assert torch.equal(reset["blocks.0.ln1.weight"], torch.ones(SMALL.d_model))
    # Two blocks of the same shape draw different values (seeded by name, not by shape).
    assert not torch.equal(first["blocks.0.fc.weight"], first["blocks.1.fc.weight"])


def test_gpt_init_weights_matches_the_eager_scheme() -> None:
    weights = wrap_meta(meta_gpt(SMALL), Strategy.OPTIM_GRADS_PARAMS).full_state_dict()
    residual = 0.02 / (2 * SMALL.num_layers) ** 0.5
    assert abs(float(weights["blocks.0.fc.weight"].std()) - 0.02) < 0.002
    assert abs(float(weights["blocks.0.out.weight"].std()) - residual) < 0.2 * residual
    assert torch.equal(weights["blocks.0.fc.bias"], torch.zeros_like(weights["blocks.0.fc.bias"]))
    assert torch.equal(weights["head.weight"], weights["tok_emb.weight"])


def test_meta_model_with_real_parameters_is_refused() -> None:
    model = meta_gpt(SMALL)
    model.ln_f = nn.LayerNorm(SMALL.d_model)
    with pytest.raises(DeferredInitError, match=r"'ln_f.weight' on cpu.*torch.device\('meta'\)"):
        FullyShardedDataParallel(model)


def test_meta_model_needs_a_real_device() -> None:
    with pytest.raises(DeferredInitError, match=r"device='cpu'"):
        FullyShardedDataParallel(meta_gpt(SMALL), device="meta")


class _Unwritten(nn.Module):
    """A module whose buffer no init writes (no `reset_parameters`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.empty(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale: torch.Tensor = self.scale  # type: ignore[assignment]
        return self.lin(x) * scale


def test_buffer_no_one_initializes_is_refused() -> None:
    with torch.device("meta"):
        model = _Unwritten()
    with pytest.raises(DeferredInitError, match=r"'scale'.*_Unwritten has no reset_parameters"):
        FullyShardedDataParallel(model)


def test_parameter_an_init_fn_skips_is_refused() -> None:
    def half(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)  # the bias stays unwritten

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(DeferredInitError, match=r"'0.bias'.*DeferredInit.init_fn.*NaN"):
        FullyShardedDataParallel(model, ShardingConfig(deferred_init=DeferredInit(init_fn=half)))


def test_deferred_init_config_is_validated() -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        DeferredInit(seed=-1)
    with pytest.raises(ValueError, match="callable"):
        DeferredInit(init_fn=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="DeferredInit"):
        ShardingConfig(deferred_init=3)  # type: ignore[arg-type]


def test_materialized_model_with_parameters_tied_across_units_trains_as_unsharded() -> None:
    """The eager path of the same layout: ZeRO-3 at world size 1 against the plain model."""
    torch.manual_seed(0)
    model = SharedFcModel()
    ref = SharedFcModel()
    ref.load_state_dict(model.state_dict())
    wrapped = FullyShardedDataParallel(model, ShardingConfig(unit_modules=(Block,)))
    assert "blocks.0.fc.weight" not in {
        s.names[0] for b in wrapped._engine.unit_buckets[0] for s in b.layout.slots
    }, "a parameter tied across units lives in the root unit"
    opt = wrapped.make_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(3):
        x, y = global_batch(step, 0, 1, 2)
        got = lm_loss(wrapped(x), y)
        got.backward()
        opt.step()
        opt.zero_grad()
        want = lm_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
    full = wrapped.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-5)
