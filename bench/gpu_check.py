"""One-shot GPU check of the sharding engine: bf16 parity at world size 1 on CUDA, timings.

Run on a CUDA machine from the repository root:

    python bench/gpu_check.py

For NO_SHARD and ZeRO-3, with no process group (local copies) and with a one-rank NCCL group
(real collectives on the communication stream), it trains a small GPT for a few AdamW steps
in bf16 with fp32 main weights and compares the per-step losses with a hand-written
mixed-precision reference (bf16 model, fp32 master copy, torch AdamW). Prints one line per
case, `PASS`/`FAIL` and milliseconds per step, and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import sys
import time

import torch
import torch.distributed as dist

# Runnable as `python bench/gpu_check.py` from a plain checkout (no install needed).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from daemon.gpt import GPT, Block, GPTConfig, lm_loss
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy

LOSS_RTOL = 1e-2


def _model(device: torch.device) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=256, num_layers=4, num_heads=4, seq_len=128)
    return GPT(cfg).to(device)


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step % 2)
    x = torch.randint(0, 256, (8, 128), generator=g)
    y = torch.randint(0, 256, (8, 128), generator=g)
    return x.to(device), y.to(device)


def _reference(device: torch.device, steps: int) -> tuple[list[float], float]:
    model = _model(device)
    master = [p.detach().float().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.1)
    losses, start = [], 0.0
    for step in range(steps):
        if step == 1:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        x, y = _batch(step, device)
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
    torch.cuda.synchronize(device)
    return losses, (time.perf_counter() - start) / max(1, steps - 1)


def _engine(device: torch.device, strategy: Strategy, steps: int) -> tuple[list[float], float]:
    config = ShardingConfig(strategy=strategy, unit_modules=(Block,), param_dtype=torch.bfloat16)
    model = FullyShardedDataParallel(_model(device), config)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    losses, start = [], 0.0
    for step in range(steps):
        if step == 1:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        x, y = _batch(step, device)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize(device)
    snap = model.stats.snapshot()
    print(
        f"    stats: hits={snap.prefetch_hits} misses={snap.prefetch_misses} "
        f"ag_peak={snap.allgather_queue_depth_peak} rs_peak={snap.reduce_queue_depth_peak} "
        + " ".join(f"{op}={t.count}" for op, t in snap.collectives.items())
    )
    full = model.full_state_dict()
    if not all(torch.isfinite(v).all() for v in full.values()):
        raise RuntimeError("non-finite weights in full_state_dict")
    return losses, (time.perf_counter() - start) / max(1, steps - 1)


def _init_nccl() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=0, world_size=1)


def main() -> int:
    """Run every case; return the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: CUDA is not available")
        return 1
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    ref, ref_s = _reference(device, args.steps)
    print(f"reference: {ref_s * 1e3:.2f} ms/step, losses {ref[0]:.4f} -> {ref[-1]:.4f}")
    failures = 0
    for group in ("local", "nccl"):
        if group == "nccl":
            _init_nccl()
        for strategy in (Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS):
            name = f"{group}/{strategy.value}"
            try:
                losses, secs = _engine(device, strategy, args.steps)
            except Exception as err:  # report every case, then fail
                print(f"FAIL {name}: {type(err).__name__}: {err}")
                failures += 1
                continue
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
            ok = worst <= LOSS_RTOL and losses[-1] < losses[0]
            failures += not ok
            print(
                f"{'PASS' if ok else 'FAIL'} {name}: {secs * 1e3:.2f} ms/step, worst loss rel "
                f"diff {worst:.2e}, losses {losses[0]:.4f} -> {losses[-1]:.4f}"
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    print("PASS" if failures == 0 else f"FAIL ({failures} cases)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
