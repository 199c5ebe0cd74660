"""A one-life run of the default job through `loop.run_training` with the memory tier on, for
tests that watch what the loop hands the cadence and the checkpoint manager."""

from __future__ import annotations

import dataclasses
from typing import Any


def memory_tier_run(
    rank: int,
    world_size: int,
    root: str,
    memory_dir: str,
    *,
    run_id: str,
    ckpt_every: int,
    memory_every: int,
    max_steps: int = 8,
) -> tuple[Any, Any, Any]:
    """`(cfg, job, control)` for `loop.run_training`: the default job on the CPU, durable root
    under `root`, the tier's directory under `memory_dir` (made here)."""
    import torch

    from daemon._config_load import load_config
    from daemon.jobs.default_job import build
    from daemon.jobs.job import JobContext
    from daemon.rundir.control import RankControl

    cfg = load_config(
        {
            "ckpt_uri": f"{root}/ckpt",
            "max_steps": str(max_steps),
            "ckpt_every": str(ckpt_every),
            "memory_every": str(memory_every),
            "memory_dir": memory_dir,
            "run_id": run_id,
            "device": "cpu",
        },
        env={},
    )
    cfg.memory_tier_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    job = dataclasses.replace(
        build(JobContext(rank=rank, world_size=world_size, seed=0)), sample=None
    )
    return cfg, job, RankControl(None, graceful_signals=False)
