"""The job seam: what `--job module:callable` must return.

A job is a callable `build(ctx: JobContext) -> JobSpec`, importable by every rank (it runs in
each rank process, after the process group exists and after `torch.manual_seed(ctx.seed)`, so
model initialisation is identical on every rank):

    from daemon import JobContext, JobSpec

    def build(ctx: JobContext) -> JobSpec:
        model = MyModel()                               # plain nn.Module, on CPU, full size
        return JobSpec(
            model=model,
            train_data=MyDataset(),                     # len() and [i] -> (inputs, targets)
            loss_fn=torch.nn.functional.cross_entropy,  # loss_fn(model(inputs), targets)
            unit_modules=(MyBlock,),                    # FSDP units (None: auto-detect)
        )

The daemon owns everything else: sharding the model (`--strategy`), the optimizer and LR schedule,
the rank-sharded deterministic loader over `train_data` (its position is checkpointed),
micro-batching, gradient clipping, checkpoints and metrics.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from daemon.errors import JobError

__all__ = ["Dataset", "JobContext", "JobSpec", "load_job"]


@runtime_checkable
class Dataset(Protocol):
    """Indexable samples: `len(ds)` and `ds[i] -> (inputs, targets)` tensors of fixed shape."""

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `index` as `(inputs, targets)`."""
        ...


@dataclasses.dataclass(kw_only=True, frozen=True)
class JobContext:
    """What a job callable is told about the process it runs in."""

    rank: int
    """Global rank."""
    world_size: int
    """Ranks in the job."""
    seed: int
    """The run's seed (`--seed`); torch's global RNG is already seeded with it."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class JobSpec:
    """What a job returns: the model, the data and the loss."""

    model: nn.Module
    """The full (unsharded) model; the daemon wraps it with the sharding engine."""
    train_data: Dataset
    """Training samples; the daemon shards them by rank and checkpoints the position."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """`loss_fn(model(inputs), targets)` -> scalar mean loss."""
    unit_modules: tuple[type[nn.Module], ...] | None = None
    """Module classes that become FSDP units; None lets the engine detect repeated blocks."""
    tokens_per_sample: int = 0
    """Tokens in one sample (for `trainingd_train_tokens_total`); 0 uses `inputs.numel()`."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise JobError(f"JobSpec.model must be an nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.train_data, Dataset):
            raise JobError("JobSpec.train_data needs __len__ and __getitem__")
        if len(self.train_data) == 0:
            raise JobError("JobSpec.train_data is empty")
        if not callable(self.loss_fn):
            raise JobError("JobSpec.loss_fn must be callable: loss_fn(outputs, targets)")
        if self.tokens_per_sample < 0:
            raise JobError("JobSpec.tokens_per_sample must be 0 (auto) or positive")


def load_job(target: str) -> Callable[[JobContext], JobSpec]:
    """Import `module:callable`.

    Raises:
        JobError: the module cannot be imported or has no such callable.
    """
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise JobError(f"job {target!r}: cannot import {module_name}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise JobError(f"job {target!r}: {module_name} has no callable {attr!r}")
    return fn
