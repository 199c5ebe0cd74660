"""Mixed-precision policy: validation, dtypes per module, casts, no silent recasts, reduce dtype.

Single-process tests run at world size 1; the training ones run on 2 gloo ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from sharding import (
    DynamicLossScale,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingConfig,
    Strategy,
)
from sharding.errors import MixedPrecisionError, ShardingError
from tests.sharding._helpers import single_thread
from tests.sharding._precision_ranks import (
    MLPBlock,
    float_mlp_runs,
    make_mlp,
    reduce_bytes,
    regression_batch,
)
from tests.support.dist import run_on_ranks

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


# ---- configuration ----


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": torch.float16}, r"param_dtype=torch.float16: .*loss_scale=DynamicLoss"),
        ({"reduce_dtype": torch.float16}, r"reduce_dtype=torch.float16: float16 needs loss sca"),
        ({"param_dtype": torch.int8}, "param_dtype must be torch.float32, torch.bfloat16 or"),
        ({"reduce_dtype": torch.float64}, "reduce_dtype must be torch.float32"),
        ({"loss_scale": 2.0**16}, "loss_scale must be a sharding.DynamicLossScale"),
        ({"output_dtype": torch.int64}, "output_dtype must be a floating-point"),
        ({"fp32_modules": (nn.LayerNorm(4),)}, r"fp32_modules must be a tuple of nn.Module"),
        ({"fp32_modules": nn.LayerNorm}, r"fp32_modules must be a tuple"),
    ],
)
def test_invalid_policies_say_how_to_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MixedPrecisionPolicy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0.0}, "init_scale must be positive and finite"),
        ({"init_scale": float("inf")}, "init_scale must be positive and finite"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval must be >= 1"),
        ({"min_scale": 2.0**20}, r"min_scale must be in \(0, init_scale"),
    ],
)
def test_invalid_loss_scales_say_how_to_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)


def test_config_param_dtype_is_a_shorthand_for_the_policy() -> None:
    assert ShardingConfig().precision == MixedPrecisionPolicy()
    assert ShardingConfig(param_dtype=BF16).precision == MixedPrecisionPolicy(param_dtype=BF16)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    cfg = ShardingConfig(mixed_precision=policy)
    assert cfg.param_dtype == BF16  # mirrors the policy for readers of the shorthand
    assert cfg.precision is policy
    with pytest.raises(ValueError, match=r"param_dtype: .*float16 needs loss scaling"):
        ShardingConfig(param_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"contradicts mixed_precision\.param_dtype"):
        ShardingConfig(param_dtype=BF16, mixed_precision=MixedPrecisionPolicy())
    with pytest.raises(ValueError, match=r"mixed_precision must be a sharding\.MixedPrecision"):
        ShardingConfig(mixed_precision=BF16)  # type: ignore[arg-type]


def _wrap(module: nn.Module, strategy: Strategy = Strategy.NO_SHARD, **policy: Any) -> Any:
    return FullyShardedDataParallel(
        module,
        ShardingConfig(
            strategy=strategy,
            unit_modules=(MLPBlock,),
            mixed_precision=MixedPrecisionPolicy(**policy),
        ),
    )


# ---- casts ----


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_float_inputs_meet_bf16_weights_and_outputs_take_output_dtype(strategy: Strategy) -> None:
    model = _wrap(make_mlp(), strategy, param_dtype=BF16, output_dtype=torch.float32)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    x, y = regression_batch(0, 0)
    out = model(x)  # fp32 features; the wrapper casts them to bf16
    assert out.dtype == torch.float32
    nn.functional.mse_loss(out, y).backward()
    opt.step()
    with model.summon_full_params():
        assert {p.dtype for p in model.parameters()} == {BF16}
    # Without output_dtype the output is what the bf16 model computed.
    assert _wrap(make_mlp(), strategy, param_dtype=BF16)(x).dtype == BF16


def test_without_input_casting_float_inputs_hit_bf16_weights() -> None:
    model = _wrap(make_mlp(), param_dtype=BF16, cast_forward_inputs=False)
    x, _ = regression_batch(0, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)
    assert model(x.to(BF16)).dtype == BF16


def test_unit_inputs_are_cast_so_fp32_activations_between_units_work() -> None:
    class Promote(nn.Module):
        """Adds an fp32 tensor between units: type promotion makes the activation fp32."""

        def __init__(self) -> None:
            super().__init__()
            self.a = MLPBlock(8)
            self.b = MLPBlock(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) + torch.ones(8)  # bf16 + fp32 -> fp32
            assert h.dtype == torch.float32
            return self.b(h)

    model = _wrap(Promote(), param_dtype=BF16)
    assert model(torch.randn(2, 8)).dtype == BF16


# ---- fp32 modules and buffers ----


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)
        self.register_buffer("offset", torch.full((8,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(self.bn(self.fc(x)) + self.offset))


def test_batchnorm_stays_fp32_by_default_and_returns_its_input_dtype() -> None:
    inner = _Normed()
    seen: dict[str, torch.dtype] = {}

    def pre(module: nn.Module, args: tuple[torch.Tensor]) -> None:
        seen["bn_in"] = args[0].dtype

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["bn_out"] = out.dtype

    inner.bn.register_forward_pre_hook(pre)
    inner.bn.register_forward_hook(post)
    model = _wrap(inner, param_dtype=BF16)
    assert inner.bn.weight.dtype == torch.float32
    assert inner.bn.running_mean.dtype == torch.float32
    assert inner.ln.weight.dtype == BF16  # norms other than BatchNorm follow param_dtype
    assert inner.fc.weight.dtype == BF16
    assert inner.offset.dtype == BF16  # floating buffers are cast with the policy
    assert inner.bn.num_batches_tracked.dtype == torch.int64
    out = model(torch.randn(4, 8))
    assert out.dtype == BF16
    # Hooks registered before wrapping see the module's own call: fp32 in, fp32 out; the
    # policy's hooks around it cast back to the surrounding bf16.
    assert seen == {"bn_in": torch.float32, "bn_out": torch.float32}
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    out.float().pow(2).mean().backward()
    opt.step()
    exported = model.full_state_dict()
    assert exported["offset"].dtype == torch.float32  # original dtypes on export
    torch.testing.assert_close(exported["offset"], torch.full((8,), 0.1), rtol=0, atol=1e-3)


def test_listed_classes_are_kept_fp32() -> None:
    inner = _Normed()
    model = _wrap(inner, param_dtype=BF16, fp32_modules=(nn.LayerNorm,))
    assert inner.ln.weight.dtype == torch.float32
    assert inner.bn.weight.dtype == BF16  # the list replaces the default
    assert inner.bn.running_var.dtype == BF16
    assert model(torch.randn(4, 8)).dtype == BF16


def test_a_bf16_model_trains_with_its_batchnorm_upcast() -> None:
    inner = _Normed().to(BF16)
    model = _wrap(inner, param_dtype=BF16)
    assert inner.bn.weight.dtype == torch.float32
    assert model(torch.randn(4, 8)).dtype == BF16


def test_a_unit_class_can_be_kept_fp32() -> None:
    inner = make_mlp()
    model = _wrap(inner, param_dtype=BF16, fp32_modules=(MLPBlock,))
    assert inner[1].fc.weight.dtype == torch.float32
    assert inner[0].weight.dtype == BF16
    x, y = regression_batch(0, 0)
    out = model(x)
    assert out.dtype == BF16
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    nn.functional.mse_loss(out.float(), y).backward()
    opt.step()


# ---- no silent recasts ----


def test_submodule_kept_in_bf16_in_an_fp32_model_is_named() -> None:
    inner = _Normed()
    inner.out.to(BF16)
    with pytest.raises(MixedPrecisionError, match=r"'out\.weight' of 'out' is stored in torch\."):
        _wrap(inner)
    # Choosing the dtype in the policy is the fix the message names.
    with pytest.raises(MixedPrecisionError, match=r"param_dtype=torch.bfloat16"):
        _wrap(inner)


def test_submodule_kept_in_fp32_in_a_bf16_model_is_named_and_can_be_kept() -> None:
    inner = _Normed().to(BF16)
    inner.out.float()
    with pytest.raises(MixedPrecisionError, match=r"'out'.*add its class \(Linear\) to"):
        _wrap(inner, param_dtype=BF16)
    model = _wrap(inner, param_dtype=BF16, fp32_modules=(nn.Linear, nn.BatchNorm1d))
    assert inner.out.weight.dtype == torch.float32
    assert inner.fc.weight.dtype == torch.float32  # every Linear is listed
    # fp32 modules hand their input's dtype back: the model stays a bf16 model outside them.
    assert model(torch.randn(4, 8)).dtype == BF16


def test_float64_parameters_are_not_silently_lowered() -> None:
    inner = _Normed()
    inner.fc.double()
    with pytest.raises(MixedPrecisionError, match=r"'fc'.*convert it with \.to\(torch\.float32\)"):
        _wrap(inner)


def test_tied_parameter_inside_and_outside_fp32_modules_is_rejected() -> None:
    inner = _Normed()
    inner.ln.weight = inner.bn.weight
    with pytest.raises(MixedPrecisionError, match=r"tied to"):
        _wrap(inner, param_dtype=BF16)


# ---- two ranks ----


@pytest.mark.slow
def test_float_input_mlp_trains_in_bf16_within_two_percent_of_fp32() -> None:
    runs = run_on_ranks(float_mlp_runs, 2, 200, timeout_s=420)
    assert runs[0] == runs[1]  # global losses
    fp32 = runs[0]["fp32"]["losses"]
    assert fp32[-1] < 0.25 * fp32[0], fp32[::20]  # it learns
    ref = sum(fp32[-20:]) / 20
    for key in ("bf16_zero3", "bf16_no_shard"):
        bf16 = runs[0][key]["losses"]
        assert bf16 != fp32  # really computed in bf16
        assert abs(bf16[-1] - fp32[-1]) <= 0.02 * fp32[-1], (key, bf16[-1], fp32[-1])
        # And over the last 20 steps (a single step's loss moves with its batch).
        tail = sum(bf16[-20:]) / 20
        assert abs(tail - ref) <= 0.02 * ref, (key, tail, ref)
    for key in ("fp16_zero3", "fp16_no_shard"):
        run = runs[0][key]
        assert run["finite"], key
        # The initial scale of 2**30 overflows: the first steps are skipped on both ranks.
        assert run["skipped"][0]
        assert sum(run["skipped"]) >= 10, run["skipped"]
        assert run["skipped"] == runs[1][key]["skipped"]
        assert run["scale"] == runs[1][key]["scale"] < 2.0**30
        # Skipped steps delay it; it still ends near the fp32 run.
        tail = sum(run["losses"][-20:]) / 20
        assert abs(tail - ref) <= 0.1 * ref, (key, tail, ref)


@pytest.fixture(scope="module")
def reduce_runs() -> list[dict[str, Any]]:
    return run_on_ranks(reduce_bytes, 2, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_bf16_reduce_moves_exactly_half_the_gradient_bytes(
    reduce_runs: list[dict[str, Any]], strategy: Strategy
) -> None:
    op = "all_reduce" if strategy is Strategy.NO_SHARD else "reduce_scatter"
    for rank in reduce_runs:
        fp32 = rank[f"{strategy.value}/{torch.float32}"]
        bf16 = rank[f"{strategy.value}/{BF16}"]
        full, half = fp32["collectives"][op], bf16["collectives"][op]
        assert full.count == half.count > 0
        assert 2 * half.num_bytes == full.num_bytes
        # Weight all-gathers are unchanged (bf16 compute weights either way).
        gathers = [run["collectives"]["all_gather"] for run in (fp32, bf16)]
        assert gathers[0].num_bytes == gathers[1].num_bytes
    # bf16 communication rounds the gradients, nothing more: the weights stay close.
    ref, got = (reduce_runs[0][f"{strategy.value}/{d}"]["weights"] for d in (torch.float32, BF16))
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=5e-3, msg=name)


# ---- fp16 with the sharded loss scaler (world size 1) ----


def _fp16(strategy: Strategy, **scale: Any) -> tuple[Any, Any]:
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, loss_scale=DynamicLossScale(**scale))
    model = FullyShardedDataParallel(
        make_mlp(),
        ShardingConfig(strategy=strategy, unit_modules=(MLPBlock,), mixed_precision=policy),
    )
    return model, model.make_optimizer(torch.optim.AdamW, lr=1e-3)


def _step(model: Any, opt: Any, step: int, *, clip: bool = False) -> None:
    x, y = regression_batch(step, 0)
    opt.scale_loss(nn.functional.mse_loss(model(x).float(), y)).backward()
    if clip:
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_overflow_skips_the_step_and_backs_off(strategy: Strategy) -> None:
    model, opt = _fp16(strategy, init_scale=2.0**40)
    before = model.full_state_dict()
    _step(model, opt, 0, clip=True)
    assert opt.last_step_skipped
    assert opt.loss_scale == 2.0**39
    assert opt.loss_scaler.num_skipped_steps == 1
    after = model.full_state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # a skipped step changes nothing
    while opt.last_step_skipped:
        _step(model, opt, 1, clip=True)
    scale = opt.loss_scale
    assert scale <= 2.0**17  # fp16's range: the scale came down to where gradients fit
    changed = model.full_state_dict()
    assert any(not torch.equal(changed[n], v) for n, v in before.items())
    assert all(bool(torch.isfinite(v).all()) for v in model.full_state_dict().values())


def test_a_skipped_step_still_ends_a_step_for_the_queue_peaks() -> None:
    model, opt = _fp16(Strategy.OPTIM_GRADS, init_scale=2.0**40)
    _step(model, opt, 0)
    assert opt.last_step_skipped
    # The skipped step's reductions are reported as the last completed step's peak.
    assert model.stats.snapshot().queue_depth_step_peak["reduce"] >= 1


def test_scale_grows_after_growth_interval_clean_steps() -> None:
    model, opt = _fp16(Strategy.OPTIM_GRADS, init_scale=2.0**8, growth_interval=2)
    _step(model, opt, 0)
    assert (opt.loss_scale, opt.loss_scaler.growth_tracker) == (2.0**8, 1)
    _step(model, opt, 1)
    assert (opt.loss_scale, opt.loss_scaler.growth_tracker) == (2.0**9, 0)
    assert opt.loss_scaler.num_skipped_steps == 0


def test_gradients_are_unscaled_before_clipping() -> None:
    # The global norm clip_grad_norm_ returns is of the unscaled gradients: the same for any
    # scale that neither overflows nor underflows, and close to the fp32 model's.
    x, y = regression_batch(0, 0)
    norms = []
    for init in (2.0**6, 2.0**12):
        model, opt = _fp16(Strategy.OPTIM_GRADS_PARAMS, init_scale=init)
        opt.scale_loss(nn.functional.mse_loss(model(x).float(), y)).backward()
        norms.append(float(opt.clip_grad_norm_(1e9)))
        assert opt.loss_scale == init
    fp32 = _wrap(make_mlp(), Strategy.OPTIM_GRADS_PARAMS)
    fp32_opt = fp32.make_optimizer(torch.optim.SGD, lr=0.1)
    nn.functional.mse_loss(fp32(x), y).backward()
    ref = float(fp32_opt.clip_grad_norm_(1e9))
    assert abs(norms[0] - norms[1]) <= 1e-3 * norms[1], norms
    assert abs(norms[1] - ref) <= 1e-2 * ref, (norms, ref)


def test_unscaled_loss_is_refused_with_loss_scaling() -> None:
    model, opt = _fp16(Strategy.OPTIM_GRADS_PARAMS)
    x, y = regression_batch(0, 0)
    nn.functional.mse_loss(model(x).float(), y).backward()
    with pytest.raises(ShardingError, match=r"optimizer\.scale_loss\(loss\)\.backward\(\)"):
        opt.step()


def test_scale_is_saved_and_restored_with_the_optimizer() -> None:
    model, opt = _fp16(Strategy.OPTIM_GRADS_PARAMS, init_scale=2.0**40)
    _step(model, opt, 0)
    state = opt.sharded_state_dict()
    assert state["loss_scaler"] == {
        "scale": 2.0**39,
        "growth_tracker": 0,
        "num_skipped_steps": 1,
    }
    _, fresh = _fp16(Strategy.OPTIM_GRADS_PARAMS, init_scale=2.0**40)
    fresh.load_sharded_state_dict(state)
    assert fresh.loss_scale == 2.0**39
    assert fresh.loss_scaler.num_skipped_steps == 1
    # Without loss scaling the optimizer has no scaler state and scale_loss is the identity.
    plain = _wrap(make_mlp()).make_optimizer(torch.optim.SGD, lr=0.1)
    assert "loss_scaler" not in plain.sharded_state_dict()
    loss = torch.ones(())
    assert plain.scale_loss(loss) is loss
    assert plain.loss_scale == 1.0
