"""Non-persistent buffers (rotary `inv_freq`) are never state: keys, old checkpoints, dtypes.

A tiny Hugging Face Llama (built in code) wrapped at world size 1 under every strategy: the
sharded state dict holds exactly `module.state_dict()`'s keys (tied names folded into
`__aliases__`), a state dict that still holds the buffers (as checkpoints written before they
were left out do) loads, directly and restored by `ckpt_manager` into today's template, and
the bf16 policy keeps the rotary frequencies in fp32 (in a tiny Qwen2 too).
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Iterator

import pytest
import torch

from sharding import FullyShardedDataParallel, MixedPrecisionPolicy, ShardingConfig, Strategy
from sharding.errors import StateDictLayoutError
from tests.sharding._helpers import single_thread
from tests.support.hf import VOCAB, tiny_model

pytest.importorskip("transformers")

ALIASES_KEY = "__aliases__"  # CONTRACTS.md: tied names in a sharded state dict

_ROTARY = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _wrap(
    module: torch.nn.Module, strategy: Strategy, precision: MixedPrecisionPolicy | None = None
) -> FullyShardedDataParallel:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    units = (LlamaDecoderLayer, Qwen2DecoderLayer)
    config = ShardingConfig(strategy=strategy, unit_modules=units, mixed_precision=precision)
    return FullyShardedDataParallel(module, config)


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sharded_state_dict_has_the_module_state_dict_keys(strategy: Strategy, tied: bool) -> None:
    ref = tiny_model("llama", tied=tied)
    expected = set(ref.state_dict())
    assert not expected & set(_ROTARY)  # the premise: transformers leaves them out
    model = _wrap(copy.deepcopy(ref), strategy)
    sharded = model.sharded_state_dict()
    aliases = sharded.pop(ALIASES_KEY, {})
    assert set(sharded) | set(aliases) == expected
    assert set(sharded).isdisjoint(aliases)
    assert tied == bool(aliases)
    assert set(model.full_state_dict()) == expected
    ref.load_state_dict(model.full_state_dict(), strict=True)


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
def test_a_state_dict_that_still_holds_the_buffers_loads(strategy: Strategy) -> None:
    source = tiny_model("llama", seed=1)
    model = _wrap(tiny_model("llama", seed=2), strategy)
    old = {k: v.clone() for k, v in source.state_dict().items()}
    # What a checkpoint written before this change held: the rotary buffers too.
    old.update({name: buf.clone() for name, buf in source.named_buffers()})
    assert set(_ROTARY) <= set(old)
    model.load_sharded_state_dict(old)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=0)
    # Any other extra key is still refused.
    old["model.not_a_buffer"] = torch.zeros(1)
    with pytest.raises(StateDictLayoutError, match=r"model\.not_a_buffer"):
        model.load_sharded_state_dict(old)


@pytest.mark.parametrize(
    "strategy", [Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS], ids=["no_shard", "zero3"]
)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_keeps_rotary_frequencies_in_fp32(kind: str, strategy: Strategy) -> None:
    ref = tiny_model(kind)
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = _wrap(copy.deepcopy(ref), strategy, precision)
    buffers = dict(model.module.named_buffers())
    for name in _ROTARY:
        assert buffers[name].dtype == torch.float32, name
        torch.testing.assert_close(buffers[name], dict(ref.named_buffers())[name], rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_a_checkpoint_that_holds_the_buffers_restores(tmp_path: pathlib.Path) -> None:
    from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager

    source = _wrap(tiny_model("llama", seed=1), Strategy.OPTIM_GRADS_PARAMS)
    old = source.sharded_state_dict()
    # The sharded state dict of the previous release: the rotary buffers, whole, as well.
    old.update({name: dict(source.module.named_buffers())[name] for name in _ROTARY})
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="old") as mgr:
        mgr.save(1, {"model": old})
    model = _wrap(tiny_model("llama", seed=2), Strategy.OPTIM_GRADS_PARAMS)
    with CheckpointManager(str(tmp_path), cfg, run_id="new") as mgr:
        result = mgr.restore(1, into={"model": model.sharded_state_dict()})
    assert result is not None
    model.load_sharded_state_dict(result.state["model"])
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_fp32_modules_by_class_name() -> None:
    from daemon.errors import JobError
    from daemon.jobs.job import fp32_module_classes

    model = tiny_model("llama")
    classes = fp32_module_classes(model, "LlamaRMSNorm, LlamaMLP")
    assert [c.__name__ for c in classes] == ["_BatchNorm", "LlamaRMSNorm", "LlamaMLP"]
    assert [c.__name__ for c in fp32_module_classes(model, "")] == ["_BatchNorm"]
    with pytest.raises(JobError, match="'RMSNorm'"):
        fp32_module_classes(model, "RMSNorm")
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp32_modules=classes)
    wrapped = _wrap(model, Strategy.NO_SHARD, precision)
    assert wrapped.module.model.norm.weight.dtype == torch.float32
    assert wrapped.module.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
