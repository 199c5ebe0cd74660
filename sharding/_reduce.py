"""The gradient reduce pipeline: reduce-scatter / all-reduce with a bounded queue.

Collectives run in the bucket's `reduce_dtype` (fp32 by default; bf16 halves the bytes): the
gradients are packed (or the fp32 local gradient copied) into it, reduced, and the result is
copied or added into the fp32 main gradient once the collective is done.

Gradients are pre-divided by the world size and summed by the collective, as DDP does (with
a power-of-two world size the division is exact, so the result equals DDP's bit for bit).

* grads-sharded strategies (`OPTIM_GRADS`, `OPTIM_GRADS_PARAMS`): every micro-batch, the
  unit's gradients are packed into a fresh `reduce_dtype` bucket and reduce-scattered. In
  fp32, the first reduction after `zero_grad` writes straight into the fp32 shard; later ones
  (and bf16 ones) go to a temporary shard copied or added into it after the collective.
  With `NoSyncMode.ACCUMULATE_UNSHARDED`, micro-batches inside `no_sync()` only add into
  the bucket's whole fp32 `held_grad`; the next one outside adds its own and is reduced
  as above, once.
* `NO_SHARD` / `OPTIM`: gradients are accumulated locally into the whole fp32 main gradient;
  on the last micro-batch it is scaled and all-reduced in place (`NO_SHARD`) or
  reduce-scattered into the shard the optimizer reads (`OPTIM`, whose local buffer then
  counts as empty again); with a bf16 `reduce_dtype` a bf16 copy is reduced instead and the
  result copied or added back into fp32.

At most `max_inflight` reductions are in flight: the oldest is waited on (and finished)
before another is issued. `drain()` at the end of backward waits for the rest.

[Note: reduce memory] Under the grads-sharded strategies each in-flight reduction holds a
full-size input bucket (a whole unit's gradients in `reduce_dtype`), and a unit's backward
allocates a whole unit's parameter gradients on top. So room in the queue is made when a
unit's backward *starts* (`reserve_for`, from the unit's pre-backward), not only when its
reductions are issued: while the unit computes, at most `max_inflight` minus its own
reductions are alive, the same number of reductions still overlaps the backward of the
next unit, and the peak is one unit's gradient bucket lower. The unit's gathered weights
are released before its gradients are packed (`Engine._finish_unit`). On gloo a
reduce-scatter also holds no clone of its input ([Note: gloo reduce-scatter] in `_comm.py`).

Hybrid sharding ([Note: hybrid layout] in `_mesh.py`): gradients are pre-divided by the whole
data-parallel world, reduce-scattered inside the shard group, and once a reduce-scatter is
waited on, its output shard is all-reduced over the replica group; that all-reduce takes the
reduce-scatter's place at the back of the queue (it counts against `max_inflight` like any
reduction) and the bucket's finishing copy or add runs after it.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import torch

from sharding._buffer import FlatBucket
from sharding._comm import Communicator, PendingCollective
from sharding._config import NoSyncMode, Strategy
from sharding._stats import ShardingStats

__all__ = ["ReducePipeline"]


def _add(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class _Inflight:
    __slots__ = ("finish", "keep", "pending", "replicate")

    def __init__(
        self,
        pending: PendingCollective,
        finish: Callable[[], None] | None,
        keep: tuple[torch.Tensor, ...],
        replicate: torch.Tensor | None,
    ) -> None:
        self.pending = pending
        self.finish = finish
        # Tensors the collective reads or writes live until it has been waited on.
        self.keep = keep
        # The reduce-scatter's output, still to be all-reduced over the replica group.
        self.replicate = replicate


class ReducePipeline:
    """Issues gradient reductions bucket by bucket and bounds how many are in flight."""

    def __init__(
        self,
        comm: Communicator,
        stats: ShardingStats,
        *,
        max_inflight: int,
        no_sync_mode: NoSyncMode = NoSyncMode.REDUCE_SCATTER,
    ) -> None:
        self._hold = no_sync_mode is NoSyncMode.ACCUMULATE_UNSHARDED
        self._comm = comm
        self._stats = stats
        self.max_inflight = max_inflight
        self._queue: collections.deque[_Inflight] = collections.deque()
        # Pre-divided by every data-parallel rank: the replica all-reduce sums the rest.
        self._scale = 1.0 / comm.dp_world_size
        self._replicas = comm.num_replicas > 1

    def __len__(self) -> int:
        return len(self._queue)

    def _pop_oldest(self) -> None:
        entry = self._queue.popleft()
        entry.pending.wait()
        self._stats.reduce_waited()
        if entry.replicate is not None:
            pending = self._comm.all_reduce_replicas(entry.replicate)
            self._push(pending, entry.finish, (*entry.keep, entry.replicate))
            return
        if entry.finish is not None:
            entry.finish()

    def _make_room(self) -> None:
        self.make_room(1)

    def make_room(self, num_new: int) -> None:
        """Wait for (and finish) the oldest reductions until `num_new` more fit under the
        bound, or the queue is empty."""
        while self._queue and len(self._queue) + num_new > self.max_inflight:
            self._pop_oldest()

    def reserve_for(self, buckets: list[FlatBucket], *, last_microbatch: bool) -> None:
        """Make room, before a unit's backward allocates its gradients, for the reductions
        that unit will issue ([Note: reduce memory]); grads-sharded strategies only (the
        others accumulate into persistent buffers)."""
        if self._hold and not last_microbatch:
            return
        num = sum(1 for b in buckets if b.trains and b.strategy.shards_grads)
        if num:
            self.make_room(num)

    def _push(
        self,
        pending: PendingCollective,
        finish: Callable[[], None] | None,
        keep: tuple[torch.Tensor, ...],
        *,
        scattered: torch.Tensor | None = None,
    ) -> None:
        """Queue one reduction; `scattered`: its output shard, all-reduced over replicas
        once it is done (hybrid only)."""
        replicate = scattered if self._replicas else None
        self._queue.append(_Inflight(pending, finish, keep, replicate))
        self._stats.reduce_issued()

    def reduce(
        self, bucket: FlatBucket, grads: list[torch.Tensor | None], *, last_microbatch: bool
    ) -> None:
        """Fold one bucket's fresh gradients in and reduce them when the strategy says so."""
        if not bucket.trains:
            return
        if bucket.strategy.shards_grads:
            if self._hold and not last_microbatch:
                bucket.held_grad = bucket.fold_grads(grads, bucket.held_grad)
                return
            # Wait for the oldest first and drop the unsharded grads once packed: fewer
            # full-size gradient buffers are alive at once.
            self._make_room()
            full = bucket.fold_grads(grads, bucket.held_grad)
            bucket.held_grad = None
            grads.clear()
            full.mul_(self._scale)
            if bucket.grad_is_zero:
                shard = bucket.new_grad_shard()
                if shard.dtype == full.dtype:
                    pending = self._comm.reduce_scatter(shard, full, scratch_input=True)
                    self._push(pending, None, (full,), scattered=shard)
                    return
                low = bucket.reduce_out()
                pending = self._comm.reduce_scatter(low, full, scratch_input=True)
                copy_back = functools.partial(_copy, shard, low)
                self._push(pending, copy_back, (full, low), scattered=low)
                return
            main = bucket.main_grad
            assert main is not None
            out = bucket.reduce_out()
            pending = self._comm.reduce_scatter(out, full, scratch_input=True)
            self._push(pending, functools.partial(_add, main, out), (full, out), scattered=out)
            return
        if not last_microbatch:
            bucket.accumulate_local(grads, scale=None)
            return
        bucket.accumulate_local(grads, scale=self._scale)
        self._make_room()
        main = bucket.main_grad
        assert main is not None
        wire = bucket.to_reduce_dtype(main)
        if bucket.strategy is Strategy.NO_SHARD:
            if wire is main:
                self._push(self._comm.all_reduce(main), None, ())
            else:
                pending = self._comm.all_reduce(wire)
                self._push(pending, functools.partial(_copy, main, wire), (wire,))
            return

        def consumed() -> None:
            bucket.local_is_zero = True

        if bucket.grad_is_zero:
            shard = bucket.new_grad_shard()
            if wire is main:
                pending = self._comm.reduce_scatter(shard, main)
                self._push(pending, consumed, (), scattered=shard)
                return
            low = bucket.reduce_out()

            def first() -> None:
                shard.copy_(low)
                bucket.local_is_zero = True

            pending = self._comm.reduce_scatter(low, wire, scratch_input=wire is not main)
            self._push(pending, first, (low, wire), scattered=low)
            return
        reduced = bucket.reduced_grad
        assert reduced is not None
        out = bucket.reduce_out()

        def finish() -> None:
            reduced.add_(out)
            bucket.local_is_zero = True

        pending = self._comm.reduce_scatter(out, wire, scratch_input=wire is not main)
        self._push(pending, finish, (out, wire), scattered=out)

    def drain(self) -> None:
        """Wait for and finish every reduction in flight."""
        while self._queue:
            self._pop_oldest()
