"""`--data`: the job trains on token files instead of its own `train_data`.

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
    """`job` with `train_data` read from `cfg.train.data` (unchanged when that is empty).

    Raises:
        JobError: the files' vocabulary does not fit the model's token table, or the job
            has no `loss_fn` for their `(inputs, targets)` samples.
        FileNotFoundError / ValueError: a file is missing or not a token file.
    """
    if not cfg.train.data:
        return job
    if job.loss_fn is None:
        raise JobError(
            "--data gives (inputs, targets) samples, and the job has no loss_fn: give "
            "JobSpec.loss_fn(outputs, targets) (e.g. cross-entropy of outputs.logits)"
        )
    sources = [s.strip() for s in cfg.train.data.split(",") if s.strip()]
    weights = (
        [float(w) for w in cfg.train.data_weights.split(",")] if cfg.train.data_weights else None
    )
    dataset = TokenDataset(
        sources,
        seq_len=job.tokens_per_sample,
        weights=weights,
        storage_options=functools.partial(data_storage_options, cfg),
    )
    table = _token_table_size(job.model)
    if table is not None and dataset.vocab_size > table:
        raise JobError(
            f"--data files have a vocabulary of {dataset.vocab_size} tokens but the job's model "
            f"embeds {table}; tokenize for this model, or use a job whose model fits"
        )
    return dataclasses.replace(job, train_data=dataset)
