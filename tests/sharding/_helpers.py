"""Models, data and rank functions shared by the sharding tests (importable by spawned ranks)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from daemon import GPT, Block, GPTConfig, lm_loss
from sharding import (
    FullyShardedDataParallel,
    NoSyncMode,
    ShardedTensor,
    ShardingConfig,
    Strategy,
    no_decay_groups,
)

SEQ = 16
VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training configuration of a parity run."""

    strategy: Strategy
    tie: bool = True
    micro_batches: int = 1
    clip: float | None = None
    unused: bool = False
    checkpointing: bool = False
    steps: int = 20
    per_rank_batch: int = 2
    param_dtype: torch.dtype = torch.float32
    prefetch: bool = True
    num_layers: int = 3
    reentrant: bool = False
    """Use the reentrant `torch.utils.checkpoint` variant."""
    fixed_data: bool = False
    """Train on the same batch every step (so the loss must go down)."""
    groups: bool = False
    """Two parameter groups: `no_decay_groups`, the no-decay one with its own `lr`."""
    no_sync_mode: NoSyncMode = NoSyncMode.REDUCE_SCATTER
    """What `no_sync()` does under the grads-sharded strategies."""


class TinyGPT(GPT):
    """`GPT` with optional activation checkpointing and never-used parameters."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        checkpointing: bool = False,
        unused: bool = False,
        reentrant: bool = False,
    ):
        super().__init__(cfg)
        self.checkpointing = checkpointing
        self.reentrant = reentrant
        if unused:
            self.blocks[0].spare = nn.Linear(8, 8)
            self.spare_root = nn.Parameter(torch.randn(5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=self.reentrant)
                if self.checkpointing
                else block(x)
            )
        return self.head(self.ln_f(x))


def make_model(setup: Setup, seed: int = 0) -> TinyGPT:
    """The tiny GPT of a setup, identically initialised for a given seed."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        d_model=32,
        num_layers=setup.num_layers,
        num_heads=2,
        seq_len=SEQ,
        tie_embeddings=setup.tie,
    )
    return TinyGPT(
        cfg, checkpointing=setup.checkpointing, unused=setup.unused, reentrant=setup.reentrant
    )


def batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and targets of one rank's micro-batch."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return x, y


def global_batch(step: int, micro: int, world: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of every rank's micro-batch (what the reference trains on)."""
    parts = [batch(step, micro, r, size) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def wrap(model: nn.Module, setup: Setup) -> FullyShardedDataParallel:
    """Wrap with the setup's strategy (Block units)."""
    return FullyShardedDataParallel(
        model,
        ShardingConfig(
            strategy=setup.strategy,
            unit_modules=(Block,),
            param_dtype=setup.param_dtype,
            prefetch=setup.prefetch,
            no_sync_mode=setup.no_sync_mode,
        ),
    )


def param_groups(model: nn.Module, setup: Setup) -> list[dict[str, Any]] | None:
    """The setup's optimizer groups of a plain or wrapped model (`None`: one group)."""
    if not setup.groups:
        return None
    groups = no_decay_groups(model, weight_decay=0.1)
    groups[1]["lr"] = 3e-3
    return groups


def train_sharded(rank: int, world: int, setup: Setup) -> dict[str, Any]:
    """Train the setup with the engine: global losses, norms, rank 0's weights, and the
    reduce-scatters of each step (with the number of trained buckets to compare them to)."""
    model = wrap(make_model(setup), setup)
    groups = param_groups(model, setup)
    opt = model.make_optimizer(torch.optim.AdamW, groups, lr=1e-3, weight_decay=0.1)
    losses, norms, reduce_scatters = [], [], []
    for step in range(setup.steps):
        before = model.stats.snapshot().collectives["reduce_scatter"].count
        total = torch.zeros(())
        for micro in range(setup.micro_batches):
            x, y = batch(0 if setup.fixed_data else step, micro, rank, setup.per_rank_batch)
            last = micro == setup.micro_batches - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                loss = lm_loss(model(x), y) / setup.micro_batches
                loss.backward()
            total += loss.detach().float()
        if setup.clip is not None:
            norms.append(float(opt.clip_grad_norm_(setup.clip)))
        opt.step()
        opt.zero_grad()
        reduce_scatters.append(model.stats.snapshot().collectives["reduce_scatter"].count - before)
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return {
        "losses": losses,
        "norms": norms,
        "weights": model.full_state_dict(),
        "reduce_scatters": reduce_scatters,
        "trained_buckets": sum(b.trains for b in model._engine.buckets),
    }


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread, as the spawned ranks use (and no thrashing on 2 shared cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_reference(setup: Setup, world: int) -> dict[str, Any]:
    """Train one unwrapped model on the global batch (the parity reference)."""
    with single_thread():
        return _train_reference(setup, world)


def _train_reference(setup: Setup, world: int) -> dict[str, Any]:
    model = make_model(setup)
    groups = param_groups(model, setup)
    opt = torch.optim.AdamW(
        model.parameters() if groups is None else groups, lr=1e-3, weight_decay=0.1
    )
    losses, norms = [], []
    for step in range(setup.steps):
        total = 0.0
        for micro in range(setup.micro_batches):
            data_step = 0 if setup.fixed_data else step
            x, y = global_batch(data_step, micro, world, setup.per_rank_batch)
            loss = lm_loss(model(x), y) / setup.micro_batches
            loss.backward()
            total += float(loss.detach())
        for p in model.parameters():
            if p.grad is None:
                # The engine's flat buffers give never-used parameters a zero gradient.
                p.grad = torch.zeros_like(p)
        if setup.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm of a - b over norm of b (absolute when b is 0)."""
    diff = torch.linalg.vector_norm((a.double() - b.double()).reshape(-1))
    ref = torch.linalg.vector_norm(b.double().reshape(-1))
    return float(diff / ref) if ref > 0 else float(diff)


def local_losses(model: nn.Module, opt: Any, rank: int, steps: int) -> list[float]:
    """Train `steps` AdamW steps on this rank's data; return this rank's local losses."""
    losses = []
    for step in range(steps):
        x, y = batch(step, 0, rank, 2)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def ddp_and_engine_losses(rank: int, world: int, strategies: list[Strategy]) -> dict[str, Any]:
    """Per-rank losses of 12 steps under torch DDP and under the engine's strategies."""
    from torch.nn.parallel import DistributedDataParallel

    setup = Setup(strategy=Strategy.NO_SHARD, steps=12)
    ddp = DistributedDataParallel(make_model(setup))
    out: dict[str, Any] = {
        "ddp": local_losses(
            ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1), rank, 12
        )
    }
    for strategy in strategies:
        model = wrap(make_model(setup), dataclasses.replace(setup, strategy=strategy))
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        out[strategy.value] = local_losses(model, opt, rank, 12)
    return out


def train_many(rank: int, world: int, setups: list[Setup]) -> list[dict[str, Any]]:
    """`train_sharded` for several setups in one process group."""
    return [train_sharded(rank, world, s) for s in setups]


def train_many_and_ddp(
    rank: int, world: int, setups: list[Setup], ddp_strategies: list[Strategy]
) -> dict[str, Any]:
    """`train_many`, then `ddp_and_engine_losses`, in one process group (one spawn for both)."""
    return {
        "runs": train_many(rank, world, setups),
        "ddp": ddp_and_engine_losses(rank, world, ddp_strategies),
    }


def state_layout(state: Any, skip: tuple[str, ...] = ()) -> Any:
    """Entries, shapes and dtypes of a (nested) state dict, values left out (and keys in
    `skip`)."""
    if isinstance(state, dict):
        return {k: state_layout(v, skip) for k, v in state.items() if k not in skip}
    if isinstance(state, list | tuple):
        return [state_layout(v, skip) for v in state]
    local = getattr(state, "local", state)
    if isinstance(local, torch.Tensor):
        return (type(state).__name__, tuple(local.shape), local.dtype)
    return type(state).__name__


def snapshot(tree: Any) -> Any:
    """Deep copy of a state dict whose tensors may be views of live buffers."""
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(snapshot(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, ShardedTensor):
        return dataclasses.replace(tree, local=tree.local.detach().clone())
    return tree


def merge_ranks(trees: list[Any]) -> Any:
    """Combine every rank's state dict: tensor leaves become lists of per-rank pieces."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: merge_ranks([t[k] for t in trees]) for k in first}
    if isinstance(first, torch.Tensor | ShardedTensor):
        return list(trees)
    return first


def mixed_precision_reference(
    setup: Setup, device: torch.device, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process bf16 compute with fp32 master weights and AdamW: what the engine does."""
    model = make_model(setup).to(device)
    master = [p.detach().float().clone() for p in model.parameters()]
    model.to(setup.param_dtype)
    opt = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, 0, 0, setup.per_rank_batch))
        loss = lm_loss(model(x), y)
        loss.backward()
        for m, p in zip(master, model.parameters(), strict=True):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters(), strict=True):
                p.copy_(m)
        losses.append(loss.item())
    names = [n for n, _ in model.named_parameters()]
    return losses, dict(zip(names, master, strict=True))


def engine_mixed_precision(
    setup: Setup, device: torch.device, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The engine at world size 1 on `device` with the setup's compute dtype."""
    model = wrap(make_model(setup).to(device), setup)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, 0, 0, setup.per_rank_batch))
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict()
