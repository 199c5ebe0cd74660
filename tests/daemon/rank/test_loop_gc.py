"""The training loop freezes the setup's objects before its first step, and unfreezes them after.

[Note: the setup's objects are frozen before the first step] in `daemon/rank/loop.py`: a full
collection then scans only what training created, not the 10^5+ objects of torch and the
model, so none runs for tens of milliseconds inside a step or a memory snapshot.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest

from daemon.rank.telemetry import NullTelemetry
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


class _FrozenAtSteps(NullTelemetry):
    """Notes the collector's frozen object count at the end of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen: list[int] = []

    def inc(self, name: str, amount: float = 1.0, label: str = "") -> None:
        if name == "trainingd_train_steps_total":
            self.frozen.append(gc.get_freeze_count())


def _frozen_counts(rank: int, world_size: int, ckpt_root: str) -> tuple[int, list[int], int]:
    import torch

    from daemon._config_load import load_config
    from daemon.jobs.default_job import build
    from daemon.jobs.job import JobContext
    from daemon.rank.loop import run_training
    from daemon.rundir.control import RankControl

    cfg = load_config(
        {"ckpt_uri": ckpt_root, "max_steps": "3", "ckpt_every": "0", "device": "cpu"}, env={}
    )
    torch.manual_seed(0)
    job = dataclasses.replace(
        build(JobContext(rank=rank, world_size=world_size, seed=0)), sample=None
    )
    telemetry = _FrozenAtSteps()
    before = gc.get_freeze_count()
    run_training(cfg, job, telemetry=telemetry, control=RankControl(None, graceful_signals=False))
    return before, telemetry.frozen, gc.get_freeze_count()


def test_the_setup_is_frozen_while_training_and_unfrozen_after(tmp_path: Path) -> None:
    [(before, during, after)] = run_on_ranks(_frozen_counts, 1, str(tmp_path), timeout_s=300)
    assert before == 0
    assert len(during) == 3
    # Everything the setup built (torch, the model, the optimizer) is out of the collector's
    # scans at every step ...
    assert all(count > 10_000 for count in during), during
    # ... and back in them once the run is over (a process may train again).
    assert after == 0
