"""Shared by the `ckptctl` tests: one real multi-rank ZeRO-3 run, saved locally and on S3.

The run is expensive (spawned gloo ranks, the sharding engine), so it happens once per
session and every `ctl/test_*` module reads its checkpoints; tests that damage or prune a
root work on a copy (`copy_root`). It has no tests of its own.
"""

from __future__ import annotations

import shutil
import uuid
from typing import Any, NamedTuple

import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, RankLocal
from daemon import GPT, Block, GPTConfig, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.support.dist import run_on_ranks
from tests.support.s3 import MotoS3, S3Target

SAVED_STEPS = (1, 2, 3, 4)
"""Steps the run commits (one optimizer step apart)."""
CFG = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, d_model=16)
"""The tiny GPT trained under ZeRO-3."""


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens and targets of one rank at one step."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)


def wrap(seed: int) -> FullyShardedDataParallel:
    """The GPT under ZeRO-3 (`OPTIM_GRADS_PARAMS`), initialised from `seed`."""
    torch.manual_seed(seed)
    config = ShardingConfig(strategy=Strategy.OPTIM_GRADS_PARAMS, unit_modules=(Block,))
    return FullyShardedDataParallel(GPT(CFG), config)


def train_and_save(
    rank: int, world: int, roots: list[tuple[str, dict[str, Any]]]
) -> dict[int, dict[str, torch.Tensor]]:
    """Train ZeRO-3, saving after each step of `SAVED_STEPS` to every root (real manager).

    Returns (rank 0) the full state dict the engine gathers at each saved step.
    """
    model = wrap(seed=0)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
    managers = [
        CheckpointManager(
            uri,
            CheckpointConfig(async_mode=AsyncMode.SYNC, storage_options=options),
            run_id="zero3",
        )
        for uri, options in roots
    ]
    fulls = {}
    try:
        for step in range(1, max(SAVED_STEPS) + 1):
            x, y = batch(step, rank)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = {
                "model": model.sharded_state_dict(),
                "optimizer": opt.sharded_state_dict(),
                "rng": RankLocal({"torch": torch.get_rng_state(), "rank": rank}),
            }
            for mgr in managers:
                mgr.save(step, state, metrics={"loss": float(loss.detach()), "tokens": step * 64})
                mgr.wait_until_finished()
            fulls[step] = model.full_state_dict()
    finally:
        for mgr in managers:
            mgr.close()
    return fulls


class Run(NamedTuple):
    """The session's ZeRO-3 checkpoints."""

    local: str
    """Local root."""
    s3: str
    """S3 root (`s3://bucket/zero3`)."""
    bucket: S3Target
    """The bucket (storage options, endpoint)."""
    fulls: dict[int, dict[str, torch.Tensor]]
    """Full state dict gathered in training, per saved step."""


_RUNS: dict[str, Run] = {}


def zero3_run(base: Any, moto: MotoS3) -> Run:
    """The session's run (made on first use); re-made if a server reset dropped its bucket."""
    run = _RUNS.get(moto.endpoint_url)
    if run is not None and run.bucket.filesystem().exists(run.s3.removeprefix("s3://")):
        return run
    bucket = moto.new_bucket("ctl-zero3")
    local = str(base / f"zero3-{uuid.uuid4().hex[:6]}")
    roots = [(local, {}), (f"{bucket.uri}/zero3", dict(bucket.storage_options))]
    fulls = run_on_ranks(train_and_save, 2, roots, timeout_s=240)[0]
    run = _RUNS[moto.endpoint_url] = Run(local, roots[1][0], bucket, fulls)
    return run


def copy_root(run: Run, backend: str, base: Any) -> str:
    """A private copy of the run's local or S3 root (for tests that damage or prune it)."""
    name = f"copy-{uuid.uuid4().hex[:8]}"
    if backend == "local":
        dest = str(base / name)
        shutil.copytree(run.local, dest)
        return dest
    fs = run.bucket.filesystem()
    src = run.s3.removeprefix("s3://")
    dest = f"{run.bucket.bucket}/{name}"
    paths = fs.find(src)
    fs.copy(paths, [dest + path.removeprefix(src) for path in paths])  # one concurrent batch
    return f"s3://{dest}"
