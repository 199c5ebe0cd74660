"""The validation loss: every `[train] eval_every` steps, on a fixed set of batches.

[Note: a validation loss equal to one process's] Each rank evaluates `eval_batches`
micro-batches of `batch_size` samples: rank `r`'s batch `b` is the samples from
`(b x world + r) x batch_size` on, so together the ranks cover the first
`eval_batches x batch_size x world` samples of `val_data` (wrapping around a smaller set), the
same ones at every evaluation (batch `k` of the set is always samples `k x batch_size` on; an
elastic job evaluates `eval_batches x max world / world` batches per rank, so every world size
evaluates the same batches). Each batch's mean loss is weighted by its tokens
(`batch.num_tokens`), and one all-reduce sums `[loss x tokens, tokens]` over the ranks: the
result is what one process computes over the same batches, whatever the world size. The
forwards run under `torch.no_grad()` with the model in `eval()` mode (dropout off), put back in
the mode it had after; a forward without grad registers no backward work in the sharding engine,
so an evaluation costs its forward passes (and their gathers) and nothing more. Evaluations run
at `step % eval_every == 0` and at `max_steps`, so a resumed run evaluates at the same steps as
one that was not stopped; nothing of the evaluation is checkpointed.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch
import torch.distributed as dist

from daemon.errors import JobError
from daemon.jobs.job import Dataset, JobSpec
from daemon.rank.batch import Batch, collate, forward_loss, num_tokens, to_device
from daemon.rank.telemetry import NullTelemetry, RankTelemetry
from daemon.rundir.progress import ProgressPhase

__all__ = ["Evaluator", "eval_indices"]

log = structlog.get_logger("trainingd.loop")


def eval_indices(
    num_samples: int, *, batch_size: int, num_batches: int, rank: int, world_size: int
) -> list[list[int]]:
    """Sample indices of each of `rank`'s evaluation batches.

    See [Note: a validation loss equal to one process's].
    """
    return [
        [((b * world_size + rank) * batch_size + i) % num_samples for i in range(batch_size)]
        for b in range(num_batches)
    ]


class Evaluator:
    """Evaluates the validation loss when due; reports it to telemetry and the log.

    Args:
        job: the job (its `val_data` and `loss_fn`).
        every: evaluate at steps that are multiples of this (0: never).
        max_steps: the run's last step (evaluated too).
        batch_size: samples per batch.
        num_batches: batches this rank evaluates.
        rank: global rank.
        world_size: ranks in the job.
        device: where batches go.
        telemetry: where `trainingd_val_loss` / `trainingd_val_step` go.

    Raises:
        JobError: `every` > 0 and the job has no `val_data`.
    """

    def __init__(
        self,
        job: JobSpec,
        *,
        every: int,
        max_steps: int,
        batch_size: int,
        num_batches: int,
        rank: int,
        world_size: int,
        device: torch.device,
        telemetry: RankTelemetry | NullTelemetry,
    ) -> None:
        if every > 0 and job.val_data is None:
            raise JobError(
                f"eval_every={every} but there is no validation data: give --val-data FILES "
                "(token files, as --data) or a JobSpec.val_data, or set eval_every=0"
            )
        self._job = job
        self._every = every
        self._max_steps = max_steps
        self._device = device
        self._telemetry = telemetry
        self._indices = (
            eval_indices(
                len(job.val_data),
                batch_size=batch_size,
                num_batches=num_batches,
                rank=rank,
                world_size=world_size,
            )
            if job.val_data is not None
            else []
        )
        self._rank = rank
        self.last: tuple[int, float] | None = None
        """`(step, val_loss)` of the newest evaluation of this process, or None."""
        if every > 0:
            # The family exists from the start (NaN: not evaluated yet; step 0).
            telemetry.set("trainingd_val_loss", float("nan"))
            telemetry.set("trainingd_val_step", 0.0)

    def due(self, step: int) -> bool:
        """Whether `step` is evaluated: a multiple of `every`, or the last step."""
        return self._every > 0 and (step % self._every == 0 or step == self._max_steps)

    def maybe_evaluate(self, model: Any, step: int) -> float | None:
        """Evaluate when `step` is due (collective: every rank calls it at every step).

        Returns:
            The validation loss at `step` (the same on every rank), or None when not due.
        """
        if not self.due(step):
            return None
        started = time.perf_counter()
        value = self.evaluate(model)
        seconds = time.perf_counter() - started
        self.last = (step, value)
        self._telemetry.set("trainingd_val_loss", value)
        self._telemetry.set("trainingd_val_step", float(step))
        if self._rank == 0:
            log.info(
                "validation",
                step=step,
                val_loss=round(value, 6),
                batches=len(self._indices),
                seconds=round(seconds, 3),
            )
        return value

    def evaluate(self, model: Any) -> float:
        """The token-weighted mean loss over every rank's batches (collective)."""
        assert self._job.val_data is not None
        data: Dataset = self._job.val_data
        was_training = model.training
        model.eval()
        try:
            totals = torch.zeros(2, dtype=torch.float64, device=self._device)
            with torch.no_grad():
                for indices in self._indices:
                    # Each forward marks progress, so a long evaluation is not taken for a hang.
                    self._telemetry.mark(ProgressPhase.FORWARD)
                    batch: Batch = to_device(collate([data[i] for i in indices]), self._device)
                    tokens = num_tokens(batch)
                    loss = forward_loss(model, self._job.loss_fn, batch)
                    totals[0] += loss.detach().double() * tokens
                    totals[1] += tokens
        finally:
            model.train(was_training)
        dist.all_reduce(totals)
        loss_tokens, tokens = totals.tolist()
        return loss_tokens / tokens
