"""The bench's job: the default job, optionally with a large state, that reports its steps.

Set `BENCH_RECOVERY_PROGRESS_DIR` and each rank process appends the wall time (`time.time()`)
at which the training loop starts a step's forward pass to `progress-rank<R>-pid<P>.txt`
there: the N-th line of an incarnation means that N-1 steps are complete (the loop starts the
next forward only after the previous step's optimizer step, agreement and checkpoint call).
The first line of the file is `restart <TORCHELASTIC_RESTART_COUNT>`. Forwards outside the
loop's `forward_backward` (the restore template's zero step, an evaluation) are not recorded.

[Note: the bench times the training thread] An earlier version recorded each batch the
loader started to fetch. The loader runs on the prefetch thread (`daemon/rank/prefetch.py`),
up to `data_prefetch` (2) batches ahead plus the one blocked on the full queue, so a kill
counted up to 3 steps as complete that the training thread had not started: `steps_lost` 3
at `memory_every 1` with the real loss at most 1, and `recovery_s` ended at the restarted
group's first fetch (the start of its first step), not at its first completed step.

`BENCH_RECOVERY_STATE_MIB` > 0 adds one trained 1-D parameter (`ballast`, zeros, no decay) to
the model so that weights plus AdamW's two moments (12 bytes per parameter) hold about that
many MiB; run it with `--strategy no_shard`, where every rank holds all of it. The ballast
takes part in the loss with weight 0, so the training of the GPT is the default job's, and its
gradient (zeros) is all-reduced and stepped like any parameter's.

Without the variables it is exactly the default job.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import IO

import torch
from torch import nn

from daemon.jobs import default_job
from daemon.jobs.gpt import GPT
from daemon.jobs.job import JobContext, JobSpec

PROGRESS_DIR_ENV = "BENCH_RECOVERY_PROGRESS_DIR"
"""Directory the ranks write their progress files to (unset: no files)."""
STATE_MIB_ENV = "BENCH_RECOVERY_STATE_MIB"
"""Extra state per rank in MiB (weights + AdamW moments of the ballast); 0 or unset: none."""
BYTES_PER_PARAM = 12
"""fp32 weight + AdamW's exp_avg and exp_avg_sq."""
_STEP_FRAME = "forward_backward"
"""The training loop's method that runs a step's forward passes (`daemon/rank/loop.py`)."""
_FRAMES_SEARCHED = 16
"""Frames between the hook and the loop's method (the sharding wrapper's call, torch's)."""


class _Ballast(nn.Module):
    """The default GPT plus one large trained parameter that does not change the loss."""

    def __init__(self, gpt: GPT, numel: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.ballast = nn.Parameter(torch.empty(numel))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.gpt(inputs)
        # Weight 0: a zero gradient for the whole ballast, the GPT's loss unchanged.
        return logits + self.ballast[:1].sum() * 0.0

    def init_weights(self, module: nn.Module) -> None:
        """`GPT.init_weights` for the GPT's modules; zeros for the ballast."""
        if module is self:
            nn.init.zeros_(self.ballast)
        else:
            self.gpt.init_weights(module)


class _Progress:
    """A forward pre-hook appending the time of each training step's forward to a file."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def __call__(self, module: nn.Module, args: object) -> None:
        # Only the loop's own forwards count ([Note: the bench times the training thread]).
        frame = sys._getframe(1)
        for _ in range(_FRAMES_SEARCHED):
            if frame is None:
                return
            if frame.f_code.co_name == _STEP_FRAME:
                self._out.write(f"{time.time():.6f}\n")
                self._out.flush()
                return
            frame = frame.f_back  # type: ignore[assignment]


def build(ctx: JobContext) -> JobSpec:
    """The default job, with the ballast and the progress files the variables ask for."""
    spec = default_job.build(ctx)
    state_mib = int(os.environ.get(STATE_MIB_ENV, "0") or 0)
    if state_mib > 0:
        assert isinstance(spec.model, GPT)
        gpt_numel = sum(p.numel() for p in spec.model.parameters())
        numel = max(state_mib * 2**20 // BYTES_PER_PARAM - gpt_numel, 1)
        with torch.device("meta"):
            model = _Ballast(spec.model, numel)
        spec = dataclasses.replace(spec, model=model, init_fn=model.init_weights, sample=None)
    progress_dir = os.environ.get(PROGRESS_DIR_ENV)
    if progress_dir:
        path = Path(progress_dir) / f"progress-rank{ctx.rank}-pid{os.getpid()}.txt"
        out = open(path, "a", encoding="ascii")  # noqa: SIM115 (open for the process's life)
        out.write(f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
        out.flush()
        spec.model.register_forward_pre_hook(_Progress(out))
    return spec
