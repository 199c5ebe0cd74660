"""The bench's job: the default job, optionally with a large state, that reports its steps.

Set `BENCH_RECOVERY_PROGRESS_DIR` and each rank process appends the wall time (`time.time()`)
at which it starts fetching a batch from the loader to `progress-rank<R>-pid<P>.txt` there:
the N-th line of an incarnation means that N-1 steps are complete (the loader fetches the next
batch only after the previous step's optimizer step, agreement and checkpoint call). The first
line of the file is `restart <TORCHELASTIC_RESTART_COUNT>`. Fetches outside the loader (the
restore template's zero step reads two samples directly) are not recorded.

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
from daemon.jobs.job import Dataset, JobContext, JobSpec

PROGRESS_DIR_ENV = "BENCH_RECOVERY_PROGRESS_DIR"
"""Directory the ranks write their progress files to (unset: no files)."""
STATE_MIB_ENV = "BENCH_RECOVERY_STATE_MIB"
"""Extra state per rank in MiB (weights + AdamW moments of the ballast); 0 or unset: none."""
BYTES_PER_PARAM = 12
"""fp32 weight + AdamW's exp_avg and exp_avg_sq."""
_LOADER_FRAME = "next_batch"
"""The loader's method that fetches a batch (`daemon/rank/data.py`)."""


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
    """`data`, appending the time of each batch the loader starts to fetch to a file."""

    def __init__(self, data: Dataset, out: IO[str]) -> None:
        self._data = data
        self._out = out
        self._last_frame: object = None

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The loader's list comprehension calls this; its frame is the loader's call (one
        # frame object per `next_batch` call, so the first fetch of a batch is a new frame).
        caller = sys._getframe(1)
        if caller.f_code.co_name != _LOADER_FRAME:
            caller = caller.f_back  # type: ignore[assignment]
        loader = caller is not None and caller.f_code.co_name == _LOADER_FRAME
        if loader and caller is not self._last_frame:
            self._last_frame = caller
            self._out.write(f"{time.time():.6f}\n")
            self._out.flush()
        item: tuple[torch.Tensor, torch.Tensor] = self._data[index]
        return item


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
        spec = dataclasses.replace(spec, train_data=_Progress(spec.train_data, out))
    return spec
