"""The training-state machine: what every hook does, per unit, per pass.

```
IDLE --forward--> FORWARD --first grad at the output--> BACKWARD --end of graph--> IDLE
```
* root pre-forward: wait on the root unit's deferred weight gathers (`OPTIM`/`OPTIM_GRADS`,
  [Note: deferred weight gather] in `_optimizer.py`); start recording the unit order; ZeRO-3
  gathers the root unit and issues the first unit ahead.
* unit pre-forward: IDLE means the inner module was called directly (error); BACKWARD means
  an activation-checkpoint recompute: unshard with backward prefetch, and for a reentrant
  recompute wrap the inputs for post-backward (see the note below); FORWARD: wait on the
  unit's deferred weight gathers, count the call, unshard with forward prefetch, wrap the
  inputs for post-backward (grad mode only).
* unit post-forward: ZeRO-3 releases the weights; register the unit's pre-backward hook.
* root pre-backward (once per backward): wait on any deferred weight gather left (a unit
  that did not run forward), queue the end-of-graph callback; ZeRO-3 issues the last
  forward unit ahead.
* unit pre-backward: if it fires before the root's (the unit's output is the wrapper's, and
  its hook was registered first), do the root pre-backward first; then make room in the
  reduce queue for the unit's reductions before its gradients are allocated ([Note: reduce
  memory] in `_reduce.py`), unshard with backward (reverse) prefetch.
* unit post-backward: once every forward call of the unit has run backward, (ZeRO-3)
  release its weights, then hand its gradients to the reduce pipeline.
* end of graph: finish units that never reported (unused, no differentiable input), then the
  root unit, drain the reduce queue, release everything, back to IDLE.

[Note: reentrant checkpointing] `checkpoint(unit, x, use_reentrant=True)` runs the unit's
forward under `no_grad` (no inputs to wrap, no output hook) and, in backward, runs it again
with grad enabled and immediately backpropagates through that recompute in a nested
backward. The recompute's pre-forward is therefore the unit's first signal in backward (it
unshards with backward prefetch), and wrapping the recompute's inputs in the post-backward
function is its last: that function's backward runs once the nested backward has produced
every gradient of the unit, so the unit is reduced and released there, as without
checkpointing (peak gathered memory: the root unit plus the units in flight). Only a unit
with a grad-less forward call still waiting for its recompute is wrapped (`_nograd_calls`):
a non-reentrant recompute is never backpropagated (its unit reports through the inputs
wrapped in forward), and a unit whose post-backward never runs is finished at the end of
the graph. Every forward call counts in `_fwd_calls`, so a unit is finished early only
once all its calls (grad-less ones through their recompute) have reported.
"""

from __future__ import annotations

from typing import Any

import torch

from sharding._allgather import Phase, UnitGather, UnshardPipeline
from sharding._buffer import FlatBucket
from sharding._comm import Communicator
from sharding._config import ShardingConfig
from sharding._hooks import (
    TrainingState,
    queue_end_of_backward,
    register_pre_backward,
    wrap_inputs,
)
from sharding._param import engine_access
from sharding._reduce import ReducePipeline
from sharding._stats import ShardingStats
from sharding.errors import UnwrappedModuleError

__all__ = ["Engine"]


class Engine:
    """Runtime state shared by the wrapper, its hooks and its optimizer."""

    def __init__(
        self,
        config: ShardingConfig,
        comm: Communicator,
        stats: ShardingStats,
        unit_buckets: list[list[FlatBucket]],
    ) -> None:
        """Build the pipelines.

        Args:
            config: the user's configuration.
            comm: the data-parallel communicator.
            stats: counters to update.
            unit_buckets: buckets of each unit; the root unit is last.
        """
        self.config = config
        self.comm = comm
        self.stats = stats
        self.unit_buckets = unit_buckets
        self.buckets = [b for group in unit_buckets for b in group]
        self.root = len(unit_buckets) - 1
        self.state = TrainingState.IDLE
        self.summoned = False
        """Inside `summon_full_params()`: every unit is whole, so the inner module may run
        (without grad) and the unit hooks have nothing to do ([Note: generation])."""
        self.is_last_microbatch = True
        num = len(unit_buckets)
        self._fwd_calls = [0] * num
        self._bwd_calls = [0] * num
        self._nograd_calls = [0] * num
        self._done = [False] * num
        self._backward_expected = False
        self.reduce = ReducePipeline(
            comm,
            stats,
            max_inflight=config.max_inflight_reductions,
            no_sync_mode=config.no_sync_mode,
        )
        stats.set_bound("reduce", config.max_inflight_reductions)
        self.gather: UnshardPipeline | None = None
        if config.strategy.shards_params:
            units = [UnitGather(i, buckets) for i, buckets in enumerate(unit_buckets)]
            stats.set_bound("allgather", len(units))
            sizes = [u.nbytes for u in units[: self.root]]
            budget = config.communication_unit_bytes or (
                2 * sum(sizes) // len(sizes) if sizes else 1
            )
            self.gather = UnshardPipeline(
                units,
                stats,
                prefetch=config.prefetch,
                budget_bytes=budget,
                counted=set(range(self.root)),
            )

    # ---- forward ----

    def check_wrapped(self) -> None:
        """Raise if the inner module runs outside the wrapper (state IDLE, not summoned)."""
        if self.state is TrainingState.IDLE and not self.summoned:
            raise UnwrappedModuleError(
                "the wrapped module was called directly; call the FullyShardedDataParallel "
                "wrapper instead (its forward gathers weights and its hooks reduce gradients)"
            )

    def root_pre_forward(self) -> None:
        """Wrapper forward starts."""
        # The root unit's parameters may be used anywhere in the wrapper's forward.
        self.wait_pending_weights(self.root, in_forward=True)
        if self.state is TrainingState.IDLE:
            self.state = TrainingState.FORWARD
        if self.gather is not None:
            self.gather.start_recording()
            # Root and first unit travel together; only the root is waited on here.
            self.gather.issue_ahead(self.root)
            if self.gather.prefetch_enabled and self.gather.order:
                self.gather.issue_ahead(self.gather.order[0])
            self.gather.unshard(self.root, Phase.FORWARD)

    def root_post_forward(self, output: Any) -> None:
        """Wrapper forward returned `output`."""
        if self.gather is not None:
            self.gather.stop_recording()
        if torch.is_grad_enabled() and register_pre_backward(output, self.root_pre_backward):
            self._backward_expected = True
        if self.state is TrainingState.FORWARD:
            self.state = TrainingState.IDLE
            if not self._backward_expected:
                # No backward will come (evaluation): this forward's calls must not count
                # against the next training step's units.
                self._reset_counts()
                if self.gather is not None:
                    self.gather.reshard_all()

    def unit_pre_forward(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Unit `index` is about to run forward."""
        self.check_wrapped()
        if self.summoned:
            return None  # already whole; no gradient work ([Note: generation])
        if self.state is TrainingState.BACKWARD:
            self.wait_pending_weights(index)
            if self.gather is not None:
                self.gather.unshard(index, Phase.BACKWARD)
            if not (torch.is_grad_enabled() and self._nograd_calls[index] > 0):
                return None
            # A reentrant checkpoint's recompute: [Note: reentrant checkpointing].
            self._nograd_calls[index] -= 1
        else:
            self.wait_pending_weights(index, in_forward=True)
            self._fwd_calls[index] += 1
            if self.gather is not None:
                self.gather.note_forward(index)
                self.gather.unshard(index, Phase.FORWARD)
            if not torch.is_grad_enabled():
                self._nograd_calls[index] += 1
                return None
        new_args, new_kwargs, _ = wrap_inputs(args, kwargs, lambda: self.unit_post_backward(index))
        return new_args, new_kwargs

    def unit_post_forward(self, index: int, output: Any) -> None:
        """Unit `index` returned `output`."""
        if self.state is not TrainingState.FORWARD:
            return
        if self.gather is not None:
            self.gather.reshard(index)
        if torch.is_grad_enabled():
            register_pre_backward(output, lambda: self.unit_pre_backward(index))

    # ---- backward ----

    def root_pre_backward(self) -> None:
        """The first gradient reached the wrapper's output."""
        if self.state is TrainingState.BACKWARD:
            return
        self.state = TrainingState.BACKWARD
        self.wait_pending_weights()
        queue_end_of_backward(self.root_post_backward)
        if self.gather is not None:
            self.gather.unshard(self.root, Phase.BACKWARD)
            if self.gather.prefetch_enabled and self.gather.order:
                self.gather.issue_ahead(self.gather.order[-1])

    def unit_pre_backward(self, index: int) -> None:
        """The gradient of unit `index`'s output is complete."""
        if self.state is not TrainingState.BACKWARD and self._backward_expected:
            # The unit's output is (part of) the wrapper's: its hook was registered first, so
            # it fires before `root_pre_backward`. The backward starts here, or the unit's
            # backward would read weights that are released or still being gathered.
            self.root_pre_backward()
        # Room for this unit's reductions before its gradients are allocated: [Note: reduce
        # memory] in `_reduce.py`.
        if self.state is TrainingState.BACKWARD:
            self.reduce.reserve_for(
                self.unit_buckets[index], last_microbatch=self.is_last_microbatch
            )
        if self.gather is not None and self.state is TrainingState.BACKWARD:
            self.gather.unshard(index, Phase.BACKWARD)

    def unit_post_backward(self, index: int) -> None:
        """Gradients of one forward call of unit `index` are complete."""
        self._bwd_calls[index] += 1
        if self._bwd_calls[index] >= self._fwd_calls[index]:
            self._finish_unit(index)

    def _finish_unit(self, index: int) -> None:
        if self._done[index]:
            return
        self._done[index] = True
        # Release the gathered weights first: backward no longer needs them, and packing
        # the gradients allocates a full-size bucket per bucket (one unit fewer alive then).
        if self.gather is not None and index != self.root:
            self.gather.reshard(index)
        for bucket in self.unit_buckets[index]:
            self.reduce.reduce(bucket, bucket.take_grads(), last_microbatch=self.is_last_microbatch)

    def root_post_backward(self) -> None:
        """End of the backward graph: finish stragglers, drain, release, reset."""
        order = self.gather.order if self.gather is not None else list(range(self.root))
        rest = [i for i in range(self.root) if i not in order]
        for index in [*order[::-1], *rest, self.root]:
            self._finish_unit(index)
        self.reduce.drain()
        if self.gather is not None:
            self.gather.reshard_all()
        self._reset_counts()
        self.state = TrainingState.IDLE

    def _reset_counts(self) -> None:
        num = len(self.unit_buckets)
        self._fwd_calls = [0] * num
        self._bwd_calls = [0] * num
        self._nograd_calls = [0] * num
        self._done = [False] * num
        self._backward_expected = False

    # ---- deferred weight gathers ----

    def buckets_in_forward_order(self) -> list[FlatBucket]:
        """Every bucket in the order a forward first needs it: the root unit's (its
        pre-forward runs first), then the units' in registration order."""
        return [b for i in [self.root, *range(self.root)] for b in self.unit_buckets[i]]

    def has_pending_weights(self) -> bool:
        """Whether some bucket's post-step weight all-gather has not been waited on yet."""
        return any(b.pending_weights is not None for b in self.buckets)

    def wait_pending_weights(self, index: int | None = None, *, in_forward: bool = False) -> None:
        """Wait on the post-step weight all-gathers of unit `index` (every unit if `None`).

        Idempotent; every reader of compute or main weights calls it first ([Note: deferred
        weight gather] in `_optimizer.py`).

        Args:
            index: the unit (the root unit is `len(unit_buckets) - 1`), or `None` for all.
            in_forward: the wait is the unit's own pre-forward one (counted apart).
        """
        buckets = self.buckets if index is None else self.unit_buckets[index]
        for bucket in buckets:
            if bucket.pending_weights is not None:
                bucket.wait_weights(in_forward=in_forward)

    # ---- outside the passes ----

    def check_no_stray_grads(self) -> None:
        """Raise if parameters hold gradients the hooks never collected."""
        with engine_access():
            stray = any(p.grad is not None for b in self.buckets for p in b.params)
        if stray:
            raise UnwrappedModuleError(
                "parameters hold gradients that the engine never reduced: backward "
                "ran through the unwrapped module (or a graph built outside the "
                "wrapper's forward); call the FullyShardedDataParallel wrapper"
            )

    def gather_all(self) -> None:
        """Gather every unit (ZeRO-3; collective), e.g. for `summon_full_params`."""
        if self.gather is not None:
            self.gather.unshard_all()

    def reshard_all(self) -> None:
        """Release every gathered unit (ZeRO-3), e.g. before weights are replaced."""
        if self.gather is not None:
            self.gather.reshard_all()
