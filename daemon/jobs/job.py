"""The job seam: what `--job module:callable` (or `--job path/to/job.py:callable`) must return.

A job is a callable `build(ctx: JobContext) -> JobSpec`, loadable by every rank (it runs in
each rank process, after the process group exists and after `torch.manual_seed(ctx.seed)`, so
model initialisation is identical on every rank):

    from daemon import JobContext, JobSpec

    def build(ctx: JobContext) -> JobSpec:
        with torch.device("meta"):                      # or on CPU, full size
            model = MyModel()                           # meta: each rank builds only its shards
        return JobSpec(
            model=model,
            train_data=MyDataset(),                     # len() and [i] -> (inputs, targets)
            val_data=MyDataset(split="val"),            # optional: [train] eval_every
            loss_fn=torch.nn.functional.cross_entropy,  # loss_fn(model(inputs), targets)
            # or: [i] -> {"input_ids": ..., "attention_mask": ..., "labels": ...}, passed
            # as model(**batch); loss_fn=None takes outputs.loss, else loss_fn(outputs, batch)
            unit_modules=(MyBlock,),                    # FSDP units (None: auto-detect)
            init_fn=None,                               # meta model: init per module
            sample=my_sample,                           # optional: text shown at the end
            init_from="s3://bucket/hf-model",           # optional: safetensors to start from
        )

The daemon owns everything else: sharding the model (`--strategy`), the optimizer and LR schedule,
the rank-sharded deterministic loader over `train_data` (its position is checkpointed),
micro-batching, gradient clipping, checkpoints and metrics.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from daemon.errors import JobError

__all__ = [
    "Dataset",
    "JobContext",
    "JobSpec",
    "fp32_module_classes",
    "job_module_name",
    "load_job",
]


@runtime_checkable
class Dataset(Protocol):
    """Indexable samples: `len(ds)` and `ds[i]`, tensors of fixed shape.

    A sample is `(inputs, targets)` or a dict of tensors passed to the model as keyword
    arguments (`input_ids`, `attention_mask`, `labels`, ...); see `daemon/rank/batch.py`.
    """

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> Any:
        """Sample `index`: `(inputs, targets)` or a dict of tensors."""
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
    val_data: Dataset | None = None
    """Validation samples (the same kind as `train_data`), evaluated every `[train]
    eval_every` steps (`daemon/rank/evaluation.py`); `--val-data` overrides it; None: none."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    """The scalar mean loss: `loss_fn(model(inputs), targets)` for `(inputs, targets)` samples,
    `loss_fn(model(**batch), batch)` for dict samples; None (dict samples only) takes the
    model's own `outputs.loss` (a Hugging Face model computes it from the batch's `labels`)."""
    unit_modules: tuple[type[nn.Module], ...] | None = None
    """Module classes that become FSDP units; None lets the engine detect repeated blocks."""
    tokens_per_sample: int = 0
    """Tokens in one sample (for `trainingd_train_tokens_total`); 0 uses `inputs.numel()`."""
    flops_per_token: float = 0.0
    """Model FLOPs of one trained token, forward and backward (e.g. `GPT.flops_per_token()`),
    for `trainingd_train_mfu_ratio`; 0: unknown, no MFU is exported."""
    init_fn: Callable[[nn.Module], None] | None = None
    """How a `model` built on the meta device is initialized, module by module
    (`sharding.DeferredInit.init_fn`, seeded from `--seed` and each module's name, e.g.
    `GPT.init_weights`); None calls each module's `reset_parameters()`. Unused for a
    materialized model."""
    init_from: str | None = None
    """Safetensors weights to start from (a directory with `model.safetensors.index.json`, a
    directory with `model.safetensors`, or one `.safetensors` file; path or URI), loaded
    before step 0 when no checkpoint exists; `--init-from` overrides it. None: the model's
    own initialisation."""
    init_key_map: Callable[[str], str] | None = None
    """Maps a name in the `init_from` files to the model's `state_dict()` name (e.g. to drop
    a `model.` prefix); None: the names are the same."""
    sample: Callable[[dict[str, torch.Tensor]], str] | None = None
    """Text shown at the end of a run that reached `max_steps` (e.g. generated by the trained
    model): called on rank 0 with the trained weights (`model.state_dict()` form); the daemon
    prints it in its summary. None shows nothing."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise JobError(f"JobSpec.model must be an nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.train_data, Dataset):
            raise JobError("JobSpec.train_data needs __len__ and __getitem__")
        if len(self.train_data) == 0:
            raise JobError("JobSpec.train_data is empty")
        if self.val_data is not None and not isinstance(self.val_data, Dataset):
            raise JobError("JobSpec.val_data must be None or have __len__ and __getitem__")
        if self.val_data is not None and len(self.val_data) == 0:
            raise JobError("JobSpec.val_data is empty: give None (no validation) or samples")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise JobError(
                "JobSpec.loss_fn must be None (dict samples: outputs.loss) or callable: "
                "loss_fn(outputs, targets)"
            )
        if self.tokens_per_sample < 0:
            raise JobError("JobSpec.tokens_per_sample must be 0 (auto) or positive")
        if self.flops_per_token < 0:
            raise JobError("JobSpec.flops_per_token must be 0 (unknown) or positive")
        if self.init_fn is not None and not callable(self.init_fn):
            raise JobError("JobSpec.init_fn must be None or callable: init_fn(module)")
        if self.init_from is not None and (
            not isinstance(self.init_from, str) or not self.init_from
        ):
            raise JobError("JobSpec.init_from must be None or a non-empty path or URI")
        if self.init_key_map is not None and not callable(self.init_key_map):
            raise JobError("JobSpec.init_key_map must be None or callable: name -> model name")
        if self.sample is not None and not callable(self.sample):
            raise JobError("JobSpec.sample must be None or callable: sample(state_dict) -> str")


def load_job(target: str) -> Callable[[JobContext], JobSpec]:
    """The job callable `target` names: `module:callable` or `path/to/job.py:callable`.

    A module is imported as usual, with the current directory on `sys.path` (appended, so it
    never shadows an installed module), so `--job my_job:build` works next to `my_job.py`. A
    file path (ending in `.py` or holding a `/`) is loaded from that file, its folder appended
    to `sys.path` so it can import its neighbours; it is registered in `sys.modules` as
    `job_module_name(target)`.

    Raises:
        JobError: a malformed target, a module or file that cannot be loaded, or no such
            callable in it.
    """
    where, attr = _split(target)
    path = _file_of(where)
    if path is None:
        _append_to_sys_path(os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise JobError(
                f"job {target!r}: cannot import {where}: {err} (a module importable from the "
                "current directory or sys.path, or a file: path/to/job.py:callable)"
            ) from err
    else:
        module = _load_file(target, path)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise JobError(f"job {target!r}: {where} has no callable {attr!r}")
    return fn


def job_module_name(target: str) -> str:
    """The name the job's module has in `sys.modules` once `load_job(target)` loaded it."""
    where, _ = _split(target)
    path = _file_of(where)
    return where if path is None else f"trainingd_job_{_identifier(path.stem)}"


def _split(target: str) -> tuple[str, str]:
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise JobError(
            f"job {target!r}: expected module:callable or path/to/job.py:callable "
            "(e.g. my_job:build)"
        )
    return where, attr


def _file_of(where: str) -> Path | None:
    """The job file `where` names, or None for a module name."""
    if where.endswith(".py") or "/" in where or os.sep in where:
        return Path(where).expanduser().resolve()
    return None


def _identifier(stem: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in stem)


def _append_to_sys_path(folder: str) -> None:
    if folder not in sys.path and not (folder == os.getcwd() and "" in sys.path):
        sys.path.append(folder)


def _load_file(target: str, path: Path) -> ModuleType:
    name = job_module_name(target)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # a second call in this process (e.g. the start-up checks)
    if not path.is_file():
        raise JobError(f"job {target!r}: no such file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobError(f"job {target!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    _append_to_sys_path(str(path.parent))
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise JobError(
            f"job {target!r}: loading {path} failed: {type(err).__name__}: {err}"
        ) from err
    return module


def fp32_module_classes(model: nn.Module, names: str) -> tuple[type[nn.Module], ...]:
    """The classes `[train] fp32_modules` names (comma-separated), BatchNorm always included.

    Raises:
        JobError: a name is not the class name of any module in the model.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    by_name = {type(m).__name__: type(m) for m in model.modules()}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise JobError(
            f"[train] fp32_modules names {unknown}, which no module of the model is; its "
            f"module classes: {sorted(by_name)[:20]}"
        )
    return (_BatchNorm, *(by_name[n] for n in wanted))
