"""A job for end-to-end tests: the default job, whose data loading can hold the ranks at a step.

A test that acts on a run while it trains (SIGTERM, killing a rank, reading metrics of a live
run) cannot learn the step from `/metrics` in time: ranks publish at most every
`publish_interval_s`, and a quick machine finishes a short run in less. So such a test runs
`trainingd run --job tests.daemon._gated_job:build` with the gate variables below set; each rank
of the worker group's *first* incarnation then counts the samples it fetches and, when it is
about to fetch the first sample past `E2E_GATE_AFTER_SAMPLES`, writes `held-rank<N>` into
`E2E_GATE_DIR` and waits there until the test creates `open`.

Runs read their batches on the training thread (`GATED_JOB` passes `--data-prefetch 0`: a
prefetch thread would reach the gate ahead of the steps). The wait is inside data loading of
the next step, so a held rank has finished its steps up to
the gate, including their stop/checkpoint agreement, and has not started the next: a stop
request made while it is held is agreed on exactly at the gate step + 1, whatever the machine's
speed. A group restarted by the agent (`TORCHELASTIC_RESTART_COUNT` > 0) is not held unless
`E2E_GATE_RESTARTS` is set (then it is held like a new group of its generation, below), and a
hold gives up after `HOLD_TIMEOUT_S` (the rank fails) so nothing waits forever.

Gates come in generations, for runs whose daemon starts new groups without a restart count
(an elastic job's membership rounds): `E2E_GATE_AFTER_SAMPLES` may list one count per
generation (`12,16`). A group built while generations 0..k-1 are open is generation k; it is
held after the k-th count, with markers `held<k>-rank<N>` and `open<k>` (plain `held-rank<N>` and
`open` for generation 0). A group built once every listed generation is open is not held.

Without `E2E_GATE_DIR` the job is exactly the default job (model, data order, loss), so a
reference run with it is bitwise comparable to a gated one.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from daemon.jobs import default_job
from daemon.jobs.job import Dataset, JobContext, JobSpec

GATE_DIR_ENV = "E2E_GATE_DIR"
"""Directory of the gate: ranks write `held-rank<N>` there; the test creates `open`."""
GATE_AFTER_SAMPLES_ENV = "E2E_GATE_AFTER_SAMPLES"
"""Samples a rank fetches before it is held (steps x batch size x micro-batches), one count per
generation, comma-separated."""
GATE_RESTARTS_ENV = "E2E_GATE_RESTARTS"
"""Set (to 1) to hold restarted groups too: a node that lost its peer and goes on alone after
a restart (an elastic job's shrink on a death) is held at its generation's count."""
HOLD_TIMEOUT_S = 150.0
"""A held rank fails after this long without `open` (the test died or forgot to open)."""


def held_marker(gate_dir: Path, rank: int, generation: int = 0) -> Path:
    """The file rank `rank` of gate generation `generation` writes once it is held."""
    return gate_dir / f"held{generation or ''}-rank{rank}"


def open_marker(gate_dir: Path, generation: int = 0) -> Path:
    """The file that releases every rank held at gate generation `generation`."""
    return gate_dir / f"open{generation or ''}"


def _generation(gate_dir: Path) -> int:
    """How many consecutive generations are open: the generation of a group built now."""
    k = 0
    while open_marker(gate_dir, k).exists():
        k += 1
    return k


class _GatedData:
    """`data`, except that fetching sample number `after_samples` + 1 waits at the gate."""

    def __init__(
        self, data: Dataset, gate_dir: Path, after_samples: int, rank: int, generation: int
    ) -> None:
        self._data = data
        self._gate_dir = gate_dir
        self._after_samples = after_samples
        self._rank = rank
        self._generation = generation
        self._num_fetched = 0

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._num_fetched == self._after_samples:
            self._hold()
        self._num_fetched += 1
        return self._data[index]

    def _hold(self) -> None:
        held_marker(self._gate_dir, self._rank, self._generation).touch()
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not open_marker(self._gate_dir, self._generation).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self._rank}: gate not opened in {HOLD_TIMEOUT_S} s")
            time.sleep(0.05)


def build(ctx: JobContext) -> JobSpec:
    """The default job, its data held at the gate when `E2E_GATE_DIR` is set (see above)."""
    spec = default_job.build(ctx)
    gate_dir = os.environ.get(GATE_DIR_ENV)
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not gate_dir or (restarted and not os.environ.get(GATE_RESTARTS_ENV)):
        return spec
    counts = [int(n) for n in os.environ[GATE_AFTER_SAMPLES_ENV].split(",")]
    generation = _generation(Path(gate_dir))
    if generation >= len(counts):
        return spec
    gated = _GatedData(spec.train_data, Path(gate_dir), counts[generation], ctx.rank, generation)
    return dataclasses.replace(spec, train_data=gated)
