"""Rank functions of the mixed-precision and buffer tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sharding import (
    BufferSync,
    DynamicLossScale,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingConfig,
    Strategy,
)

FEATURES = 16


class MLPBlock(nn.Module):
    """Linear + GELU, the FSDP unit of the float-input MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.fc(x))


def make_mlp(seed: int = 0, width: int = 64, depth: int = 3) -> nn.Sequential:
    """A float-input regression MLP (inputs are features, not token ids)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, width),
        *(MLPBlock(width) for _ in range(depth)),
        nn.Linear(width, 1),
    )


def regression_batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float features and targets of a fixed smooth function (the same task on every run)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(size, FEATURES, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * x[:, 4:8].pow(2).mean(1, keepdim=True)
    return x, y


def train_float_mlp(
    rank: int, world: int, policy: MixedPrecisionPolicy, strategy: Strategy, steps: int
) -> dict[str, Any]:
    """`steps` AdamW steps of the float-input MLP under `policy`.

    Returns:
        Global mean losses, the final loss scale, skipped steps (per step) and whether every
        final weight is finite.
    """
    model = FullyShardedDataParallel(
        make_mlp(),
        ShardingConfig(strategy=strategy, unit_modules=(MLPBlock,), mixed_precision=policy),
    )
    opt = model.make_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.0)
    losses, skipped = [], []
    for step in range(steps):
        x, y = regression_batch(step, rank)
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        skipped.append(opt.last_step_skipped)
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    weights = model.full_state_dict()
    return {
        "losses": losses,
        "scale": opt.loss_scale,
        "skipped": skipped,
        "finite": all(bool(torch.isfinite(w).all()) for w in weights.values()),
    }


FP16 = MixedPrecisionPolicy(
    param_dtype=torch.float16,
    # 2**30 overflows fp16 gradients for sure: the first steps must be skipped.
    loss_scale=DynamicLossScale(init_scale=2.0**30, growth_interval=25),
)


def float_mlp_runs(rank: int, world: int, steps: int) -> dict[str, dict[str, Any]]:
    """The float-input MLP in fp32, bf16 and fp16 with loss scaling (ZeRO-3 and NO_SHARD)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    zero3, ddp = Strategy.OPTIM_GRADS_PARAMS, Strategy.NO_SHARD
    return {
        "fp32": train_float_mlp(rank, world, MixedPrecisionPolicy(), zero3, steps),
        "bf16_zero3": train_float_mlp(rank, world, bf16, zero3, steps),
        "bf16_no_shard": train_float_mlp(rank, world, bf16, ddp, steps),
        "fp16_zero3": train_float_mlp(rank, world, FP16, zero3, steps),
        "fp16_no_shard": train_float_mlp(rank, world, FP16, ddp, steps),
    }


def reduce_bytes(rank: int, world: int) -> dict[str, Any]:
    """Collective totals and final weights after 3 steps, per strategy and reduce dtype."""
    out: dict[str, Any] = {}
    for strategy in Strategy:
        for reduce_dtype in (torch.float32, torch.bfloat16):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            model = FullyShardedDataParallel(
                make_mlp(),
                ShardingConfig(strategy=strategy, unit_modules=(MLPBlock,), mixed_precision=policy),
            )
            opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
            for step in range(3):
                x, y = regression_batch(step, rank)
                nn.functional.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad()
            out[f"{strategy.value}/{reduce_dtype}"] = {
                "collectives": model.stats.snapshot().collectives,
                "weights": model.full_state_dict(),
            }
    return out


class BNBlock(nn.Module):
    """Linear + BatchNorm1d + ReLU (BatchNorm running statistics are buffers)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


def make_bn_model() -> nn.Sequential:
    """A small float-input model with two BatchNorm layers inside units."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(FEATURES, 32), BNBlock(32), BNBlock(32), nn.Linear(32, 1))


def _bn_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = regression_batch(step, rank, size=16)
    # Rank-dependent statistics, so rank-local running stats drift apart.
    return x * (1.0 + rank) + rank, y


def _bn_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def batchnorm_buffers(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Buffers after `steps` steps under DDP (both broadcast settings) and the engine."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for broadcast in (True, False):
        ddp = DistributedDataParallel(make_bn_model(), broadcast_buffers=broadcast)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(steps):
            x, y = _bn_batch(step, rank)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[f"ddp/{broadcast}"] = _bn_buffers(ddp.module)
    for mode in BufferSync:
        for strategy in (Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS):
            inner = make_bn_model()
            model = FullyShardedDataParallel(
                inner,
                ShardingConfig(strategy=strategy, unit_modules=(BNBlock,), buffer_sync=mode),
            )
            sgd = model.make_optimizer(torch.optim.SGD, lr=0.05)
            for step in range(steps):
                x, y = _bn_batch(step, rank)
                nn.functional.mse_loss(model(x), y).backward()
                sgd.step()
                sgd.zero_grad()
            out[f"{mode.value}/{strategy.value}"] = _bn_buffers(inner)
    return out
