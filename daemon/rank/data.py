"""The rank-sharded, deterministic, checkpointable training-data loader.

Every epoch is a permutation of the sample indices seeded by `(seed, epoch)`: a Feistel network
computed index by index (`daemon/rank/permutation.py`), so the loader's memory does not grow
with the number of samples (10^9 virtual samples cost what 10 do). Global batch `b` of an epoch
is the slice `[b*G, (b+1)*G)` of it, with `G = batch_size * world_size`, and rank `r` takes
the `r`-th `batch_size` piece. The position is counted in *global samples consumed* within the
epoch, so it means the same thing at any world size (an elastic restart with fewer ranks
continues where the job was, not where one rank was), and it is identical on every rank: the
checkpoint stores it once, as a replicated value.
A trailing partial global batch is dropped so every rank always gets a full batch.
With `pin_memory` (a CUDA rank) batches are stacked into page-locked memory, so the rank's
`non_blocking` copy to the GPU is a real asynchronous DMA.
"""

from __future__ import annotations

from typing import Any

from daemon.jobs.job import Dataset
from daemon.rank.batch import Batch, collate, pin
from daemon.rank.permutation import FeistelPermutation

__all__ = ["ShardedLoader"]


class ShardedLoader:
    """Yields this rank's micro-batches in a deterministic, resumable order.

    Args:
        dataset: the samples.
        batch_size: samples per micro-batch on each rank.
        rank: this rank.
        world_size: number of ranks.
        seed: seed of the shuffling.
        pin_memory: return batches in page-locked memory (for `non_blocking` copies to a GPU).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        pin_memory: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self._dataset = dataset
        self._batch = batch_size
        self._rank = rank
        self._global = batch_size * world_size
        if len(dataset) < self._global:
            raise ValueError(
                f"dataset has {len(dataset)} samples, fewer than one global batch "
                f"({batch_size} x {world_size} ranks); lower batch_size"
            )
        self._seed = seed
        self._pin = pin_memory
        self.epoch = 0
        """Current epoch (starts at 0)."""
        self.samples_consumed = 0
        """Global samples consumed in the current epoch (all ranks together)."""
        self._order: FeistelPermutation | None = None

    def _permutation(self) -> FeistelPermutation:
        # Plain Python ints, no tensor: reading an index is not a host read of a tensor (see
        # `tests/daemon/rank/test_loop_host_syncs.py`), and nothing of size n is ever built.
        if self._order is None:
            self._order = FeistelPermutation(len(self._dataset), seed=self._seed, epoch=self.epoch)
        return self._order

    def next_batch(self) -> Batch:
        """This rank's next micro-batch: stacked `(inputs, targets)` or a dict (`batch.py`)."""
        if self.samples_consumed + self._global > len(self._dataset):
            self.epoch += 1
            self.samples_consumed = 0
            self._order = None
        start = self.samples_consumed + self._rank * self._batch
        order = self._permutation()
        indices = [order[i] for i in range(start, start + self._batch)]
        self.samples_consumed += self._global
        batch = collate([self._dataset[i] for i in indices])
        return pin(batch) if self._pin else batch

    def state_dict(self) -> dict[str, Any]:
        """The position: `{"epoch", "samples_consumed", "seed"}` (plain JSON)."""
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed, "seed": self._seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by `state_dict` (at any world size)."""
        if int(state["seed"]) != self._seed:
            raise ValueError(
                f"the checkpoint's data order used seed {state['seed']}, this run uses "
                f"{self._seed}; resume with the same --seed"
            )
        self.epoch = int(state["epoch"])
        # Round down to this world size's global batch so every rank gets a full batch.
        self.samples_consumed = int(state["samples_consumed"]) // self._global * self._global
        self._order = None
