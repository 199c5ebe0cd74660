"""The training loop reads device values on the host once per step, not once per micro-batch.

On CUDA every `.item()`, `float(t)`, `int(t)`, `bool(t)` or `.tolist()` of a device tensor
blocks the host until the GPU has caught up, so the host can no longer queue work ahead of
it. On the CPU there is no device, but the same calls can be counted: a rank at world size 1
runs the real loop with those Tensor methods wrapped, and a telemetry that marks each step's
end splits the counts into steps.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.rank.telemetry import NullTelemetry
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

_SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__")
_DAEMON = str(Path(__file__).resolve().parents[3] / "daemon")


class _StepMarks(NullTelemetry):
    """Snapshots the sync counts at the end of every step (`trainingd_train_steps_total`)."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts
        self.marks: list[collections.Counter[str]] = []

    def inc(self, name: str, amount: float = 1.0, label: str = "") -> None:
        if name == "trainingd_train_steps_total":
            self.marks.append(collections.Counter(self.counts))


def _count_syncs(counts: collections.Counter[str]) -> None:
    for name in _SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            counts["daemon" if caller.startswith(_DAEMON) else "other"] += 1
            return _original(self, *args)

        setattr(torch.Tensor, name, counted)


def _syncs_per_step(
    rank: int, world_size: int, ckpt_root: str, micro_batch_counts: list[int]
) -> list[list[Any]]:
    """Per micro-batch count: the sync counts of each whole-step window of a 6-step run.

    The runs share one rank process (one torch import) and one wrapping of the Tensor
    methods; each run marks its own steps, so its windows hold only its own reads.
    """
    from daemon._config_load import load_config
    from daemon.jobs.default_job import build
    from daemon.jobs.job import JobContext
    from daemon.rank.loop import run_training
    from daemon.rundir.control import RankControl

    counts: collections.Counter[str] = collections.Counter()
    _count_syncs(counts)
    windows = []
    for micro_batches in micro_batch_counts:
        cfg = load_config(
            {
                "ckpt_uri": f"{ckpt_root}/micro-{micro_batches}",
                "max_steps": "6",
                "batch_size": "2",
                "micro_batches": str(micro_batches),
                "ckpt_every": "0",
                "async_mode": "sync",
                "device": "cpu",
            },
            env={},
        )
        torch.manual_seed(0)
        # No sample hook: generating text reads logits on the host by design, after training.
        spec = build(JobContext(rank=rank, world_size=world_size, seed=0))
        job = dataclasses.replace(spec, sample=None)
        telemetry = _StepMarks(counts)
        control = RankControl(None, graceful_signals=False)
        run_training(cfg, job, telemetry=telemetry, control=control)
        # A window from one step's end to the next holds one whole step (no save:
        # ckpt_every=0 and the final save comes after the last mark); the first step also
        # builds lazy state.
        marks = telemetry.marks
        windows.append([dict(marks[i + 1] - marks[i]) for i in range(1, len(marks) - 1)])
    return windows


def test_the_loop_reads_the_device_once_per_step_at_any_micro_batch_count(
    tmp_path: Path,
) -> None:
    [(one, four)] = run_on_ranks(_syncs_per_step, 1, str(tmp_path), [1, 4], timeout_s=300)
    assert len(one) == len(four) == 4
    # Nothing anywhere (loop, engine, checkpoint manager) reads a tensor per micro-batch ...
    assert one == four, (one, four)
    # ... and the loop itself reads once per step: loss, grad norm, stop and checkpoint
    # requests come back in one `.tolist()` of the agreement tensor.
    assert all(window.get("daemon", 0) == 1 for window in four), four
