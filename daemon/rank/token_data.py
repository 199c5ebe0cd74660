"""`--data` / `--val-data`: the job trains (validates) on token files instead of its own
`train_data` (`val_data`).

The job still gives the model, loss and `tokens_per_sample` (the sample length); the daemon
swaps its dataset for a `daemon.data.TokenDataset` over the configured files. A file whose
vocabulary is larger than the model's token table is refused before any step, with both sizes,
rather than failing later on an out-of-range embedding lookup.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from daemon._storage import data_storage_options
from daemon.config import DaemonConfig
from daemon.data import TokenDataset
from daemon.errors import JobError
from daemon.jobs.job import JobSpec

__all__ = ["with_token_data"]


def _token_table_size(model: nn.Module) -> int | None:
    """Rows of the model's first embedding (its vocabulary), None if it has none."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    return None


def with_token_data(cfg: DaemonConfig, job: JobSpec) -> JobSpec:
    """`job` with `train_data` read from `cfg.train.data` and `val_data` from
    `cfg.train.val_data` (each unchanged when its setting is empty).

    Raises:
        JobError: the files' vocabulary does not fit the model's token table, or the job
            has no `loss_fn` for their `(inputs, targets)` samples.
        FileNotFoundError / ValueError: a file is missing or not a token file.
    """
    tc = cfg.train
    if tc.data:
        weights = [float(w) for w in tc.data_weights.split(",")] if tc.data_weights else None
        job = dataclasses.replace(
            job, train_data=_token_dataset(cfg, job, tc.data, "--data", weights)
        )
    if tc.val_data:
        job = dataclasses.replace(
            job, val_data=_token_dataset(cfg, job, tc.val_data, "--val-data", None)
        )
    return job


def _token_dataset(
    cfg: DaemonConfig, job: JobSpec, files: str, flag: str, weights: list[float] | None
) -> TokenDataset:
    """A `TokenDataset` over the comma-separated `files`, checked against the job's model."""
    if job.loss_fn is None:
        raise JobError(
            f"{flag} gives (inputs, targets) samples, and the job has no loss_fn: give "
            "JobSpec.loss_fn(outputs, targets) (e.g. cross-entropy of outputs.logits)"
        )
    sources = [s.strip() for s in files.split(",") if s.strip()]
    dataset = TokenDataset(
        sources,
        seq_len=job.tokens_per_sample,
        weights=weights,
        storage_options=functools.partial(data_storage_options, cfg),
    )
    table = _token_table_size(job.model)
    if table is not None and dataset.vocab_size > table:
        raise JobError(
            f"{flag} files have a vocabulary of {dataset.vocab_size} tokens but the job's "
            f"model embeds {table}; tokenize for this model, or use a job whose model fits"
        )
    return dataset
