"""A job for end-to-end tests: the default job, one rank of which spins in a Python loop.

`trainingd run --job tests.daemon._spin_job:build --data-prefetch 0` with `E2E_SPIN_RANK` and
`E2E_SPIN_AFTER_SAMPLES` set: that rank of the worker group's *first* incarnation, about to
fetch the sample past `E2E_SPIN_AFTER_SAMPLES` (steps x batch size x micro-batches), loops in
pure Python in `_spin` on one line (`SPIN_MARK` marks it) instead of returning, so its peers
block in their next collective: a rank stuck in the job's own code, as the hang detector must
name it. A group restarted by the agent (`TORCHELASTIC_RESTART_COUNT` > 0) trains normally,
and the loop gives up after `SPIN_TIMEOUT_S` (the rank fails) so nothing spins forever.
Batches are read on the training thread (`--data-prefetch 0`): a prefetch thread would spin
while the loop waits on its queue.

Without `E2E_SPIN_RANK` the job is exactly the default job.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from daemon.jobs import default_job
from daemon.jobs.job import Dataset, JobContext, JobSpec

SPIN_RANK_ENV = "E2E_SPIN_RANK"
"""The global rank that spins."""
SPIN_AFTER_SAMPLES_ENV = "E2E_SPIN_AFTER_SAMPLES"
"""Samples that rank fetches before it spins."""
SPIN_TIMEOUT_S = 150.0
"""The spinning rank fails after this long (the test died or nothing detected the hang)."""
SPIN_MARK = "# E2E spin line"
"""The comment on the line the rank spins on (tests find the line number by it)."""


def _spin() -> None:
    deadline = time.monotonic() + SPIN_TIMEOUT_S
    while time.monotonic() < deadline: pass  # E2E spin line  # fmt: skip  # noqa: E701
    raise TimeoutError(f"spun {SPIN_TIMEOUT_S} s: the hang was not detected")


class _SpinningData:
    """`data`, except that fetching sample number `after_samples` + 1 spins."""

    def __init__(self, data: Dataset, after_samples: int) -> None:
        self._data = data
        self._after_samples = after_samples
        self._num_fetched = 0

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._num_fetched == self._after_samples:
            _spin()
        self._num_fetched += 1
        return self._data[index]


def build(ctx: JobContext) -> JobSpec:
    """The default job, rank `E2E_SPIN_RANK`'s data spinning in its first incarnation."""
    spec = default_job.build(ctx)
    spin_rank = os.environ.get(SPIN_RANK_ENV)
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if spin_rank is None or int(spin_rank) != ctx.rank or not first:
        return spec
    spinning = _SpinningData(spec.train_data, int(os.environ[SPIN_AFTER_SAMPLES_ENV]))
    return dataclasses.replace(spec, train_data=spinning)
