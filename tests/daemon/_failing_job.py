"""A job for end-to-end tests of failures: the default job, failing where a test says.

`trainingd run --job tests.daemon._failing_job:build` with:

* `FAILING_JOB_STEP=N`: the job's loss raises `ValueError("the job fails at step N")` in the
  forward pass of step N (the N-th training call of the loss: run with one micro-batch and no
  checkpoint before step N, so every attempt starts at step 1). `FAILING_JOB_RANK=r` limits
  it to global rank r (default: every rank).
* `FAILING_JOB_BUILD=1`: the job's build raises `RuntimeError` (on the ranks; the daemon's
  start-up check only imports the job).
* `FAILING_JOB_INIT_FROM=<uri>`: the job names that source as its `init_from` (checked on the
  ranks, unlike `--init-from`, which the daemon checks before it starts them).

Without these variables it is exactly the default job.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from daemon.jobs import default_job
from daemon.jobs.job import JobContext, JobSpec

STEP_ENV = "FAILING_JOB_STEP"
"""The step whose forward pass raises."""
RANK_ENV = "FAILING_JOB_RANK"
"""The only global rank that raises (unset: every rank)."""
BUILD_ENV = "FAILING_JOB_BUILD"
"""`1`: the build raises."""
INIT_FROM_ENV = "FAILING_JOB_INIT_FROM"
"""The job's own `init_from`."""


def build(ctx: JobContext) -> JobSpec:
    """The default job, failing as the environment says (see above)."""
    if os.environ.get(BUILD_ENV) == "1":
        raise RuntimeError("the job's build fails on purpose")
    spec = default_job.build(ctx)
    if INIT_FROM_ENV in os.environ:
        spec = dataclasses.replace(spec, init_from=os.environ[INIT_FROM_ENV])
    step = os.environ.get(STEP_ENV)
    only = os.environ.get(RANK_ENV)
    if step is None or (only is not None and int(only) != ctx.rank):
        return spec
    fail_at = int(step)
    loss_fn = spec.loss_fn
    num_calls = 0

    def failing_loss(outputs: Any, targets: Any) -> torch.Tensor:
        nonlocal num_calls
        if torch.is_grad_enabled():
            num_calls += 1
            if num_calls == fail_at:
                raise ValueError(f"the job fails at step {fail_at}")
        return loss_fn(outputs, targets)

    return dataclasses.replace(spec, loss_fn=failing_loss)
