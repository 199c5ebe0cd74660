"""A job for end-to-end tests: the default job, one rank of which is slow for a while.

`trainingd run --job tests.daemon._slow_rank_job:build` with `E2E_SLOW_RANK`,
`E2E_SLOW_FROM_STEP`, `E2E_SLOW_UNTIL_STEP` and `E2E_SLOW_FACTOR` set: that rank's loss, on
every micro-batch of the steps in [from, until), sleeps `factor` times a normal micro-batch's
time on the training thread: its compute time grows, as a rank with a slower CPU or GPU, a
throttled device or a noisy neighbour has; its peers only wait for it in collectives. The
step is counted in loss calls divided by the micro-batches (`E2E_SLOW_MICRO_BATCHES`,
default 1), so the slowdown starts and ends at chosen steps whatever the machine's speed.

Without `E2E_SLOW_RANK` the job is exactly the default job.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import torch

from daemon.jobs import default_job
from daemon.jobs.job import JobContext, JobSpec

SLOW_RANK_ENV = "E2E_SLOW_RANK"
"""The global rank that is slow."""
SLOW_FROM_ENV = "E2E_SLOW_FROM_STEP"
"""The first slow step (counted from this process's first step, 0-based)."""
SLOW_UNTIL_ENV = "E2E_SLOW_UNTIL_STEP"
"""The first step that is fast again."""
SLOW_FACTOR_ENV = "E2E_SLOW_FACTOR"
"""How many times the forward pass's time the rank sleeps on a slow step."""


class _SlowLoss:
    """`loss_fn`, sleeping `factor` x a normal micro-batch's time on steps in [first, until).

    A normal micro-batch's time is the median interval between two loss calls before `first`
    (collective waits included: at least its compute), so the slow rank's compute is at least
    `factor` + 1 times its peers' on any machine.
    """

    def __init__(self, loss_fn: Any, first: int, until: int, factor: float, micro: int) -> None:
        self._loss_fn = loss_fn
        self._first, self._until, self._factor, self._micro = first, until, factor, micro
        self._num_calls = 0
        self._last_call: float | None = None
        self._intervals: list[float] = []

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        loss: torch.Tensor = self._loss_fn(outputs, targets)
        step = self._num_calls // self._micro
        self._num_calls += 1
        now = time.perf_counter()
        if step < self._first and self._last_call is not None:
            self._intervals.append(now - self._last_call)
        self._last_call = now
        if self._first <= step < self._until and self._intervals:
            time.sleep(self._factor * statistics.median(self._intervals))
        return loss


def build(ctx: JobContext) -> JobSpec:
    """The default job, rank `E2E_SLOW_RANK` slow on the chosen steps."""
    spec = default_job.build(ctx)
    slow_rank = os.environ.get(SLOW_RANK_ENV)
    if slow_rank is None or int(slow_rank) != ctx.rank:
        return spec
    slow = _SlowLoss(
        spec.loss_fn,
        int(os.environ[SLOW_FROM_ENV]),
        int(os.environ[SLOW_UNTIL_ENV]),
        float(os.environ[SLOW_FACTOR_ENV]),
        int(os.environ.get("E2E_SLOW_MICRO_BATCHES", "1")),
    )
    return dataclasses.replace(spec, loss_fn=slow)
