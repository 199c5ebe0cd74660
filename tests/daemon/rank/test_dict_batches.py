"""Dict batches through the real rank loop: tiny Llama, Qwen2 and GPT-2 with padding masks
match DDP.

Each sample is `{"input_ids", "attention_mask", "labels"}` (right padding on some rows, the
padded labels -100), passed as `model(**batch)`; with no `loss_fn` the loss is the model's
own `outputs.loss`. On 2 ranks the loop (`run_training`) under every strategy must end with
the weights and loss of a DDP reference that runs the same steps by hand: the loader's order,
AdamW in the same groups, the warmup schedule and gradient clipping. The three models (untied
Llama and Qwen2 with rotary buffers and grouped-query attention, Qwen2's q/k/v biases, GPT-2's
tied head and learned positions) run in the same two spawned ranks: a rank group costs more
than the models' runs.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from daemon.rank.batch import collate, forward_loss, num_tokens
from tests.support.dist import run_on_ranks
from tests.support.hf import VOCAB, tiny_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

_SEQ = 8
ALIASES_KEY = "__aliases__"  # CONTRACTS.md: tied names in a sharded state dict
_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_KINDS = ("llama", "qwen2", "gpt2")


class _Padded(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token rows of random lengths 3..8, right-padded: ids 0, mask 0, labels -100."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, VOCAB, (16, _SEQ), generator=g)
        self.lengths = torch.randint(3, _SEQ + 1, (16,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(_SEQ) < self.lengths[i]).long()
        ids = self.ids[i] * mask
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }


def _config(root: str, strategy: str) -> Any:
    from daemon._config_load import load_config

    flags = {"ckpt_uri": root, "max_steps": "3", "batch_size": "2", "ckpt_every": "0"}
    flags |= {"async_mode": "sync", "device": "cpu", "warmup_steps": "2", "lr": "0.01"}
    flags |= {"strategy": strategy, "grad_clip": "0.5"}
    return load_config(flags, env={})


# [Note: key biases] A bias added to the keys has a gradient of nearly cancelling terms: a
# constant added to every key shifts all of a query's scores equally and changes no softmax.
# In GPT-2 (no rotary embedding) its exact gradient is 0, in Qwen2 only the rotation between
# positions leaves a little (its fp32 value is good to about 2e-4 relative, measured against
# float64 on these batches). AdamW divides each gradient by its own magnitude, so two correct
# summation orders (DDP's bucketed all-reduce, the engine's reduce-scatter) end the 3 steps a
# few 1e-6 apart there (1.6e-6 in Qwen2's k_proj.bias, 3.3e-6 in GPT-2's c_attn.bias). Key
# biases get 1e-4, everything else 1e-6; a wrong update moves a weight by about the learning
# rate (1e-2). The engine refuses float64 weights, which would have removed the rounding.
_ATOL = 1e-6
_KEY_BIAS_ATOL = 1e-4


def _key_bias(kind: str, name: str) -> slice:
    """The elements of weight `name` that are a key bias ([Note: key biases]); maybe none."""
    if kind == "qwen2" and name.endswith("self_attn.k_proj.bias"):
        return slice(None)
    if kind == "gpt2" and name.endswith("attn.c_attn.bias"):
        return slice(32, 64)  # c_attn is [query | key | value], n_embd = 32 each
    return slice(0, 0)


def _assert_weight_close(
    kind: str, name: str, got: torch.Tensor, want: torch.Tensor, where: str
) -> None:
    """`got` equals `want` within 1e-6, key biases within 1e-4 ([Note: key biases])."""
    keys = torch.zeros(want.shape, dtype=torch.bool)
    keys[_key_bias(kind, name)] = True
    for part, atol in ((~keys, _ATOL), (keys, _KEY_BIAS_ATOL)):
        torch.testing.assert_close(
            got[part], want[part], rtol=0, atol=atol, msg=lambda m: f"{where} {name}: {m}"
        )


def _unit_modules(kind: str) -> tuple[type[torch.nn.Module], ...]:
    """Each model's decoder block class (its FSDP unit)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return {"llama": (LlamaDecoderLayer,), "qwen2": (Qwen2DecoderLayer,), "gpt2": (GPT2Block,)}[
        kind
    ]


def _ddp_reference(
    rank: int, world_size: int, kind: str, cfg: Any
) -> tuple[dict[str, torch.Tensor], float]:
    """The loop's steps by hand on DDP: the final weights and the last step's global loss."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from daemon.rank.data import ShardedLoader
    from daemon.rank.loop import _lr_lambda
    from sharding import no_decay_groups

    plain = tiny_model(kind, seed=0)
    ddp = DistributedDataParallel(plain)
    tc = cfg.train
    groups = no_decay_groups(plain, tc.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    loader = ShardedLoader(
        _Padded(), batch_size=tc.batch_size, rank=rank, world_size=world_size, seed=tc.seed
    )
    loss = torch.zeros(())
    for _ in range(tc.max_steps):
        loss = forward_loss(ddp, None, loader.next_batch())
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(plain.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    dist.all_reduce(loss)
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}, float(loss) / world_size


def _runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {kind: _runs_of(kind, rank, world_size, f"{root}/{kind}") for kind in _KINDS}


def _runs_of(kind: str, rank: int, world_size: int, root: str) -> dict[str, Any]:
    from daemon.jobs.job import JobSpec
    from daemon.rank.loop import run_training
    from daemon.rank.telemetry import NullTelemetry
    from daemon.rundir.control import RankControl

    losses = {}
    for strategy in _STRATEGIES:
        model = tiny_model(kind, seed=0)
        job = JobSpec(model=model, train_data=_Padded(), unit_modules=_unit_modules(kind))
        control = RankControl(None, graceful_signals=False)
        cfg = _config(f"{root}/{strategy}", strategy)
        result = run_training(cfg, job, telemetry=NullTelemetry(), control=control)
        losses[strategy] = result.last_loss
    weights, loss = _ddp_reference(rank, world_size, kind, _config(root, "no_shard"))
    return {"losses": losses, "ddp_weights": weights, "ddp_loss": loss}


def test_dict_batches_with_padding_match_ddp(tmp_path: pathlib.Path) -> None:
    first, _ = run_on_ranks(_runs, 2, str(tmp_path), timeout_s=400)
    for kind in _KINDS:
        _check_against_ddp(kind, first[kind], tmp_path / kind)


def _check_against_ddp(kind: str, result: dict[str, Any], root: pathlib.Path) -> None:
    """Every strategy's last loss and checkpointed weights are the DDP reference's."""
    reference = result["ddp_weights"]
    initial = tiny_model(kind, seed=0).state_dict()
    for strategy in _STRATEGIES:
        where = f"{kind} {strategy}"
        assert result["losses"][strategy] == pytest.approx(result["ddp_loss"], abs=1e-6), where
        cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
        with CheckpointManager(str(root / strategy), cfg, run_id="r") as mgr:
            restored = mgr.restore()
        assert restored is not None
        assert restored.step == 3
        saved = dict(restored.state["model"])
        # GPT-2's head is tied to its embedding: the checkpoint names it once.
        aliases = saved.pop(ALIASES_KEY, {})
        assert (kind == "gpt2") == bool(aliases), where
        # No rotary buffers (Llama, Qwen2): they are not persistent.
        assert set(saved) | set(aliases) == set(reference), where
        for name, value in reference.items():
            got = saved[aliases.get(name, name)].reshape(value.shape)
            _assert_weight_close(kind, name, got, value, where)
        # Training moved the weights.
        head = saved[aliases.get("lm_head.weight", "lm_head.weight")].reshape(-1)
        assert not torch.equal(head, initial["lm_head.weight"].reshape(-1)), where


def test_batches_collate_by_key_and_count_input_ids() -> None:
    data = _Padded()
    batch = collate([data[0], data[1]])
    assert isinstance(batch, dict)
    assert batch["attention_mask"].shape == (2, _SEQ)
    assert num_tokens(batch) == 2 * _SEQ
    pairs = collate([(torch.zeros(3), torch.ones(3))] * 2)
    assert isinstance(pairs, tuple)
    assert num_tokens(pairs) == 6
