"""Models and rank functions of the deferred-init tests (importable by spawned ranks).

Three models, all built on the meta device and materialized by the engine:
* the big GPT (`big_gpt`): 16 blocks of ~1.8 MiB (28 MiB), for peak memory and bitwise weights;
* the small GPT (`small_gpt`): 20 training steps against a single-process run;
* `SharedFcModel`: every block uses the first block's `fc` (a parameter tied across FSDP
  units, which then lives in the root unit) and a non-persistent buffer that only its
  module's `reset_parameters()` initializes; default init (`reset_parameters()`).
"""

from __future__ import annotations

import gc
import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from daemon import GPT, Block, GPTConfig, lm_loss
from sharding import DeferredInit, FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import SEQ, VOCAB, batch
from tests.sharding._memory_ranks import _fix_mmap_threshold, _reset_peak, _status_bytes

BIG = GPTConfig(d_model=192, num_layers=16, num_heads=4, seq_len=SEQ)
SMALL = GPTConfig(d_model=32, num_layers=3, num_heads=2, seq_len=SEQ)
SEED = 7
STEPS = 20
TIED_STEPS = 8
LR, WD = 1e-3, 0.1


class PositionTable(nn.Module):
    """A sinusoidal position table: a non-persistent buffer written by `reset_parameters`."""

    def __init__(self, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(seq_len, d_model), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill the table in place (deterministic, no RNG)."""
        seq_len, d_model = self.table.shape
        pos = torch.arange(seq_len, dtype=torch.float32, device=self.table.device)[:, None]
        freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float32, device=self.table.device)
            * (-math.log(10_000.0) / d_model)
        )
        with torch.no_grad():
            self.table[:, 0::2] = torch.sin(pos * freq)
            self.table[:, 1::2] = torch.cos(pos * freq)


class SharedFcModel(nn.Module):
    """Blocks sharing one MLP input projection (tied across units), sinusoidal positions."""

    def __init__(self, cfg: GPTConfig = SMALL) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = PositionTable(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        for block in list(self.blocks)[1:]:
            block.fc = self.blocks[0].fc  # type: ignore[union-attr]
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits `(batch, seq, vocab)`."""
        table: torch.Tensor = self.pos.table  # type: ignore[assignment]
        x = self.tok_emb(idx) + table[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def meta_gpt(cfg: GPTConfig) -> GPT:
    """A GPT built on the meta device."""
    with torch.device("meta"):
        return GPT(cfg)


def wrap_meta(
    model: nn.Module,
    strategy: Strategy,
    *,
    seed: int = SEED,
    init: bool = True,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> FullyShardedDataParallel:
    """Wrap a meta model with Block units; GPTs get `GPT.init_weights` unless `init` is off."""
    init_fn = model.init_weights if init and isinstance(model, GPT) else None
    return FullyShardedDataParallel(
        model,
        ShardingConfig(
            strategy=strategy,
            unit_modules=(Block,),
            deferred_init=DeferredInit(seed=seed, init_fn=init_fn),
        ),
        process_group=group,
        device=device,
    )


def digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every tensor's bytes (bitwise comparison without shipping the tensors)."""
    return {
        name: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
        for name, t in weights.items()
    }


def train(
    model: FullyShardedDataParallel, steps: int, group: dist.ProcessGroup | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Initial full weights (group rank 0) and the global losses of `steps` AdamW steps."""
    initial = model.full_state_dict()
    opt = model.make_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        x, y = batch(step, 0, model.rank, 2)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / model.world_size)
    return initial, losses


def _sharded_bytes(model: FullyShardedDataParallel) -> int:
    total = 0
    for bucket in model._engine.buckets:
        total += bucket.main_weight.nbytes
        shard = bucket.param_shard
        if shard is not None and shard.data_ptr() != bucket.main_weight.data_ptr():
            total += shard.nbytes
    return total


def _unit_bytes(model: FullyShardedDataParallel) -> list[int]:
    """fp32 bytes of each unit in full, the root unit last."""
    return [
        sum(b.layout.padded_numel * 4 for b in buckets) for buckets in model._engine.unit_buckets
    ]


def deferred_init_checks(rank: int, world: int) -> dict[str, Any]:
    """Everything multi-rank in one launch of 4 ranks (results of global ranks 0 and 2 hold
    those of world size 4 and 2).

    World size 4, ZeRO-3: the small GPT's initial weights and 20 training losses; the big
    GPT's wrap peak and its weights. World size 2 (ranks {0, 1} and {2, 3}, each pair its
    own group): the big GPT's weights (ZeRO-3), the small one's under every strategy, the
    shared-fc model's initial weights and training losses.
    """
    assert world == 4
    _fix_mmap_threshold()
    out: dict[str, Any] = {}
    initial, losses = train(wrap_meta(meta_gpt(SMALL), Strategy.OPTIM_GRADS_PARAMS), STEPS)
    if rank == 0:
        out.update(small_initial=initial, losses=losses)
    big_meta = meta_gpt(BIG)
    gc.collect()
    start = _status_bytes("VmRSS")
    _reset_peak()
    big = wrap_meta(big_meta, Strategy.OPTIM_GRADS_PARAMS)
    peak = _status_bytes("VmHWM") - start
    units = _unit_bytes(big)
    out["memory"] = {
        "peak": peak,
        "sharded": _sharded_bytes(big),
        "largest_unit": max(units),
        "whole": sum(units),
    }
    full = big.full_state_dict()
    if rank == 0:
        out["big"] = digests(full)
    del big, full

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    full = wrap_meta(meta_gpt(BIG), Strategy.OPTIM_GRADS_PARAMS, group=pair).full_state_dict()
    two: dict[str, Any] = {"big": digests(full)}
    del full
    for strategy in Strategy:
        two[strategy.value] = digests(
            wrap_meta(meta_gpt(SMALL), strategy, group=pair).full_state_dict()
        )
    with torch.device("meta"):
        tied = SharedFcModel()
    initial, losses = train(
        wrap_meta(tied, Strategy.OPTIM_GRADS_PARAMS, group=pair), TIED_STEPS, pair
    )
    two.update(tied_initial=initial, tied_losses=losses)
    if rank % 2 == 0:
        out["two"] = two
    return out
