"""What a micro-batch is and how the loop runs the model on one: tuples or dicts of tensors.

A dataset's sample is either `(inputs, targets)` (the original seam: `loss_fn(model(inputs),
targets)`) or a dict of tensors such as a Hugging Face model takes (`input_ids`,
`attention_mask`, `labels`, ...). Samples are stacked key by key (or position by position)
into a micro-batch. A dict batch is passed to the model as keyword arguments, `model(**batch)`;
its loss is `loss_fn(outputs, batch)` when the job gives a `loss_fn`, else the model's own
`outputs.loss` (a `ModelOutput` computes it when the batch holds `labels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from daemon.errors import JobError

__all__ = ["Batch", "collate", "forward_loss", "num_tokens", "pin", "to_device"]

Batch = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
"""One micro-batch: `(inputs, targets)` stacked, or a dict of stacked tensors."""


def collate(samples: Sequence[Any]) -> Batch:
    """Stack samples (all tuples, or all dicts with the same keys) into one micro-batch.

    Raises:
        JobError: a sample is neither a tuple nor a dict of tensors, or the samples disagree.
    """
    first = samples[0]
    if isinstance(first, dict):
        keys = list(first)
        if any(not isinstance(s, dict) or list(s) != keys for s in samples):
            raise JobError(f"dict samples must all have the keys {keys}")
        return {k: torch.stack([s[k] for s in samples]) for k in keys}
    if isinstance(first, tuple | list) and len(first) == 2:
        return tuple(torch.stack([s[i] for s in samples]) for i in range(2))
    raise JobError(
        "a sample must be (inputs, targets) or a dict of tensors (input_ids, attention_mask, "
        f"labels, ...), got {type(first).__name__}"
    )


def pin(batch: Batch) -> Batch:
    """The batch in page-locked memory (for `non_blocking` copies to a GPU)."""
    if isinstance(batch, dict):
        return {k: v.pin_memory() for k, v in batch.items()}
    return tuple(t.pin_memory() for t in batch)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on `device` (`non_blocking`: copies from pinned memory overlap)."""
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return tuple(t.to(device, non_blocking=True) for t in batch)


def forward_loss(
    model: Any, loss_fn: Callable[..., torch.Tensor] | None, batch: Batch
) -> torch.Tensor:
    """Run the model on the batch; its scalar loss.

    Raises:
        JobError: a tuple batch without a `loss_fn`, or a dict batch whose outputs have no
            `loss` and no `loss_fn` was given.
    """
    if isinstance(batch, dict):
        outputs = model(**batch)
        if loss_fn is not None:
            return loss_fn(outputs, batch)
        loss = getattr(outputs, "loss", None)
        if loss is None and isinstance(outputs, dict):
            loss = outputs.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise JobError(
                "JobSpec.loss_fn is None and the model's outputs have no loss: put `labels` "
                "in the batch (Hugging Face models then return outputs.loss) or give a "
                "loss_fn(outputs, batch)"
            )
        return loss
    if loss_fn is None:
        raise JobError("(inputs, targets) samples need JobSpec.loss_fn(outputs, targets)")
    inputs, targets = batch
    return loss_fn(model(inputs), targets)


def num_tokens(batch: Batch) -> int:
    """Tokens in a micro-batch: `input_ids` (else the first tensor) of a dict, else inputs."""
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values())))
        return int(first.numel())
    return int(batch[0].numel())
