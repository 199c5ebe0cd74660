"""Rank functions of the measured-memory tests: peak RSS of one ZeRO-3 forward + backward.

[Note: measuring gathered weights with RSS] glibc's malloc serves a large allocation from
its own `mmap` and unmaps it on free once the mmap threshold is fixed (`mallopt`; left
dynamic, it rises after the first large free and later buffers stay in the heap), so the
resident set follows tensor memory. The kernel's high-water mark (`VmHWM`, reset by
writing 5 to `/proc/self/clear_refs`) then gives the true peak of a step without sampling.
Gradients would blur the picture (sharded gradients grow with every reduced unit), so the
model's block matrices are frozen: they are still gathered for forward and for backward
(the input gradients need them) and released per unit, but they get no gradients. What
remains is gathered weights, a few trained vectors and small activations.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import torch

from daemon import Block, GPTConfig, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.sharding._helpers import VOCAB, TinyGPT, batch

_M_MMAP_THRESHOLD = -3
MODES = ("plain", "non_reentrant", "reentrant")


def _fix_mmap_threshold() -> None:
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} missing from /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(mode: str, d_model: int, num_layers: int) -> TinyGPT:
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=d_model, num_layers=num_layers, num_heads=4, seq_len=16)
    model = TinyGPT(cfg, checkpointing=mode != "plain", reentrant=mode == "reentrant")
    assert model.tok_emb.num_embeddings == VOCAB
    for block in model.blocks:
        for param in block.parameters():
            if param.ndim == 2:
                param.requires_grad_(False)
    return model


def step_peaks(rank: int, world: int, d_model: int, num_layers: int) -> dict[str, Any]:
    """Per mode: measured peak RSS above the step's start, the engine's peak, unit sizes."""
    _fix_mmap_threshold()
    out: dict[str, Any] = {}
    for mode in MODES:
        model = FullyShardedDataParallel(
            _model(mode, d_model, num_layers),
            ShardingConfig(strategy=Strategy.OPTIM_GRADS_PARAMS, unit_modules=(Block,)),
        )
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        peaks = []
        for step in range(3):
            x, y = batch(step, 0, rank, 1)
            gc.collect()
            start = _status_bytes("VmRSS")
            _reset_peak()
            lm_loss(model(x), y).backward()
            peaks.append(_status_bytes("VmHWM") - start)
            opt.step()
            opt.zero_grad()
        engine = model._engine
        assert engine.gather is not None
        *units, root = [sum(b.nbytes_full for b in group) for group in engine.unit_buckets]
        out[mode] = {
            # The first step also allocates the optimizer's sharded gradients for good.
            "measured_peak": min(peaks[1:]),
            "stats_peak": model.stats.snapshot().gathered_bytes_peak,
            "units": units,
            "root": root,
            "released": all(not b.full_allocated for b in engine.buckets),
        }
        del model, opt, engine
    return out
