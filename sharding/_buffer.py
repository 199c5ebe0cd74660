"""Storage of one bucket: flat compute weights, fp32 main weights and fp32 main gradients.

Which buffers exist and which are sharded follows `Strategy` (see its table). Parameters of
the wrapped module are replaced by `nn.Parameter`s that alias slices of `full_param`; under
ZeRO-3 the storage behind `full_param` is resized to 0 between uses and back to full size for
an all-gather, so the parameter objects (and the tensors autograd saved) stay valid while
the memory is released.

Dtypes (see [Note: mixed precision] in `_precision.py`): compute weights are in the bucket's
`compute_dtype`; main weights and main gradients are fp32; gradients travel in
`reduce_dtype` (packed in it, pre-divided in it, added into the fp32 main gradient after).
"""

from __future__ import annotations

import torch

from sharding._comm import Communicator, PendingCollective
from sharding._config import Strategy
from sharding._layout import BucketLayout
from sharding._param import Gate, ManagedParameter, engine_access

__all__ = ["FlatBucket"]


def _flat_range(
    layout: BucketLayout,
    sources: list[torch.Tensor],
    start: int,
    end: int,
    device: torch.device,
) -> torch.Tensor:
    """Elements `[start, end)` of the flat fp32 bucket of `sources` (zeros in the gaps)."""
    out = torch.zeros(end - start, dtype=torch.float32, device=device)
    with torch.no_grad():
        for slot, src in zip(layout.slots, sources, strict=True):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                piece = src.reshape(-1)[lo - slot.offset : hi - slot.offset]
                out[lo - start : hi - start].copy_(piece)
    return out


class FlatBucket:
    """Runtime buffers of one `BucketLayout` on this rank."""

    def __init__(
        self,
        layout: BucketLayout,
        strategy: Strategy,
        comm: Communicator,
        compute_dtype: torch.dtype,
        sources: list[torch.Tensor],
        *,
        unit_name: str = "",
        reduce_dtype: torch.dtype = torch.float32,
        broadcast: bool = True,
    ) -> None:
        """Copy `sources` (one tensor per slot) in, take rank 0's values, then shard.

        Args:
            layout: where each parameter lives.
            strategy: what is sharded.
            comm: the data-parallel communicator (rank 0's values are broadcast).
            compute_dtype: dtype of the model weights used by forward and backward.
            sources: current values of the parameters, in slot order.
            unit_name: the owning unit's name (error messages).
            reduce_dtype: dtype the gradients are communicated in.
            broadcast: take rank 0's values. False when `sources` are the same on every
                rank already (deferred init): then under ZeRO-3 only this rank's shard is
                copied and the whole bucket is never allocated.
        """
        self.layout = layout
        self.strategy = strategy
        self.comm = comm
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.start, self.end = layout.shard_range(comm.rank)
        self.saves_pieces = comm.replica_rank == 0
        """Whether this rank's pieces go into state dicts: replica 0 of a hybrid layout
        saves each shard, the other replicas save empty pieces (see `_state_dict.py`)."""
        device = comm.device
        n = layout.padded_numel
        same = compute_dtype == torch.float32
        self.main_weight: torch.Tensor
        """fp32 weights the optimizer updates: this rank's shard, or whole under NO_SHARD."""
        self.param_shard: torch.Tensor | None = None
        if strategy.shards_params and not broadcast:
            # Deferred init (`_materialize.py`): the whole bucket never exists on this rank.
            self.main_weight = _flat_range(layout, sources, self.start, self.end, device)
            self.param_shard = self.main_weight if same else self.main_weight.to(compute_dtype)
            # Storage comes with the first gather (`free_full` below releases this one).
            self.full_param = torch.empty(n, dtype=compute_dtype, device=device)
        else:
            full32 = _flat_range(layout, sources, 0, n, device)
            if broadcast:
                # Every rank starts from rank 0's weights, as DDP does.
                comm.broadcast_(full32)
            self.full_param = full32 if same else full32.to(compute_dtype)
            if not strategy.shards_optimizer:
                self.main_weight = full32
            elif same and not strategy.shards_params:
                self.main_weight = full32[self.start : self.end]
            else:
                self.main_weight = full32[self.start : self.end].clone()
            if strategy.shards_params:
                self.param_shard = (
                    self.main_weight if same else self.full_param[self.start : self.end].clone()
                )
        self.params: list[ManagedParameter] = [
            ManagedParameter(
                self.full_param[s.offset : s.offset + s.numel].view(s.shape),
                requires_grad=layout.requires_grad,
            )
            for s in layout.slots
        ]
        self.gate = Gate(unit_name)
        """Open while the parameters may be used (see `sharding/_param.py`)."""
        self.pending_weights: PendingCollective | None = None
        """The weight all-gather `refresh_weights` issued after an optimizer step and nobody
        has waited on yet ([Note: deferred weight gather] in `_optimizer.py`)."""
        for param, slot in zip(self.params, layout.slots, strict=True):
            param.attach(self.gate, slot.names[0])
        self.trains = layout.requires_grad
        """Whether the bucket has gradients and an optimizer (its parameters require grad)."""
        # Sharded gradients exist only between the first reduction and `zero_grad` (like
        # `set_to_none`, so they do not add to the peak of the next forward); the whole local
        # gradient of NO_SHARD / OPTIM is persistent, as DDP's buckets are.
        self.main_grad: torch.Tensor | None = None
        self.reduced_grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []
        if self.trains and not strategy.shards_grads:
            self.main_grad = torch.zeros(n, dtype=torch.float32, device=device)
            self.grad_views = [
                self.main_grad[s.offset : s.offset + s.numel].view(s.shape) for s in layout.slots
            ]
        # [Note: lazy gradient zeroing] `zero_grad` clears flags instead of buffers: the next
        # write overwrites. `local_is_zero`: the whole local `main_grad` (NO_SHARD, OPTIM)
        # holds nothing; `grad_is_zero`: the sharded gradient the optimizer reads holds
        # nothing (it is dropped; the next reduce-scatter allocates it and writes straight
        # into it). Padding and alignment
        # gaps are zero from construction and only ever receive sums of zeros.
        # `settle_grad` zeroes for real if the optimizer runs before any reduction.
        self.local_is_zero = True
        self.grad_is_zero = True
        self.held_grad: torch.Tensor | None = None
        """Whole fp32 gradients held back by `no_sync()` (`NoSyncMode.ACCUMULATE_UNSHARDED`,
        grads-sharded strategies), not yet reduced; `None` when nothing is held."""
        self._pads = [
            torch.zeros(b - a, dtype=reduce_dtype, device=device) for a, b in layout.gaps()
        ]
        self._pieces_order = self._piece_order()
        self.nbytes_full = n * self.full_param.element_size()
        if strategy.shards_params:
            self.free_full()

    def _piece_order(self) -> list[tuple[bool, int]]:
        """Sequence of (is_param, index) pieces that tile the bucket."""
        order, pos, gap = [], 0, 0
        for i, slot in enumerate(self.layout.slots):
            if slot.offset > pos:
                order.append((False, gap))
                gap += 1
            order.append((True, i))
            pos = slot.offset + slot.numel
        if pos < self.layout.padded_numel:
            order.append((False, gap))
        return order

    # ---- unsharded weights (ZeRO-3) ----

    @property
    def full_allocated(self) -> bool:
        """Whether `full_param` currently has storage."""
        return self.full_param.untyped_storage().nbytes() > 0

    def alloc_full(self) -> None:
        """Give `full_param` (and the parameter views) storage again, contents undefined."""
        if not self.full_allocated:
            self.full_param.untyped_storage().resize_(self.nbytes_full)

    def free_full(self) -> None:
        """Release the unsharded weights (parameters keep their shapes, lose their storage)."""
        self.gate.open = False
        self.full_param.untyped_storage().resize_(0)

    def gather_params(self) -> PendingCollective:
        """Allocate and start filling `full_param` from every rank's `param_shard`."""
        assert self.param_shard is not None
        self.alloc_full()
        return self.comm.all_gather(self.full_param, self.param_shard)

    # ---- gradients ----

    def take_grads(self) -> list[torch.Tensor | None]:
        """Collect the parameters' `.grad` (and clear them: the engine owns gradients now)."""
        grads = []
        with engine_access():
            for p in self.params:
                grads.append(p.grad)
                p.grad = None
        return grads

    def accumulate_local(self, grads: list[torch.Tensor | None], scale: float | None) -> None:
        """Fold gradients into the whole fp32 `main_grad` (`NO_SHARD`, `OPTIM`), then scale it.

        The first micro-batch after `zero_grad` overwrites, multiplying on the way when
        `scale` is given (one pass, as DDP's copy into its bucket); later ones add.
        """
        assert self.main_grad is not None
        if not self.local_is_zero:
            pairs = [(v, g) for v, g in zip(self.grad_views, grads, strict=True) if g is not None]
            if pairs:
                torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])
            if scale is not None:
                self.main_grad.mul_(scale)
            return
        for view, grad in zip(self.grad_views, grads, strict=True):
            if grad is None:
                view.zero_()
            elif scale is not None and grad.dtype == torch.float32:
                torch.mul(grad, scale, out=view)
            else:
                view.copy_(grad)
                if scale is not None:
                    view.mul_(scale)
        self.local_is_zero = False

    def flat_grads(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """One fresh full-size `reduce_dtype` bucket of `grads` (zeros: `None`, gaps, padding)."""
        pieces = []
        for is_param, i in self._pieces_order:
            if not is_param:
                pieces.append(self._pads[i])
                continue
            g = grads[i]
            slot = self.layout.slots[i]
            pieces.append(
                g.reshape(-1)
                if g is not None
                else torch.zeros(slot.numel, dtype=self.reduce_dtype, device=self.comm.device)
            )
        out = torch.empty(
            self.layout.padded_numel, dtype=self.reduce_dtype, device=self.comm.device
        )
        torch.cat(pieces, out=out)
        return out

    def fold_grads(
        self, grads: list[torch.Tensor | None], into: torch.Tensor | None
    ) -> torch.Tensor:
        """Add `grads` into the whole fp32 bucket `into`, or pack them fresh if it is `None`."""
        if into is None:
            return self.flat_grads(grads)
        pairs = [
            (into[s.offset : s.offset + s.numel].view(s.shape), g)
            for s, g in zip(self.layout.slots, grads, strict=True)
            if g is not None
        ]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])
        return into

    def to_reduce_dtype(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` (fp32) as the collective's input: itself, or a `reduce_dtype` copy."""
        return grad if self.reduce_dtype == grad.dtype else grad.to(self.reduce_dtype)

    def reduce_out(self) -> torch.Tensor:
        """A fresh `reduce_dtype` shard for a reduce-scatter to write into."""
        return torch.empty(
            self.layout.shard_numel, dtype=self.reduce_dtype, device=self.comm.device
        )

    def optimizer_grad(self) -> torch.Tensor | None:
        """The fp32 gradient the optimizer reads (shape of `main_weight`), if it exists."""
        return self.reduced_grad if self.strategy is Strategy.OPTIM else self.main_grad

    def new_grad_shard(self) -> torch.Tensor:
        """Allocate the sharded gradient the optimizer reads; the next reduction fills it."""
        shard = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=self.comm.device)
        if self.strategy is Strategy.OPTIM:
            self.reduced_grad = shard
        else:
            self.main_grad = shard
        self.grad_is_zero = False
        return shard

    def zero_grad(self) -> None:
        """Forget accumulated gradients (lazily: see the note in `__init__`)."""
        with engine_access():
            for p in self.params:
                p.grad = None
        self.held_grad = None
        self.local_is_zero = True
        self.grad_is_zero = True
        if self.strategy.shards_optimizer:
            self.reduced_grad = None
            if self.strategy.shards_grads:
                self.main_grad = None

    def settle_grad(self) -> None:
        """Make `optimizer_grad()` hold real values (zeros if nothing was reduced into it)."""
        if not self.trains:
            return
        if not self.strategy.shards_optimizer:
            if self.local_is_zero:
                assert self.main_grad is not None
                self.main_grad.zero_()
                self.local_is_zero = False
        elif self.grad_is_zero:
            self.new_grad_shard().zero_()

    def write_back_full(self) -> None:
        """Copy this rank's range of the (gathered, edited) compute weights into main weights.

        `push_main_weights` must follow, so every copy of the weights agrees again.
        """
        own = self.full_param[self.start : self.end]
        with torch.no_grad():
            if not self.strategy.shards_optimizer:
                if self.main_weight.data_ptr() != self.full_param.data_ptr():
                    self.main_weight.copy_(self.full_param)
            elif self.main_weight.data_ptr() != own.data_ptr():
                self.main_weight.copy_(own)

    # ---- after the optimizer step ----

    def refresh_weights(self) -> None:
        """`push_main_weights`, keeping its all-gather pending on the bucket (not waited).

        Until `wait_weights()` the gate is closed, so a checked read of a parameter waits
        first (see `Gate.settle`). See [Note: deferred weight gather] in `_optimizer.py`.
        """
        pending = self.push_main_weights()
        if pending is None:
            return
        self.pending_weights = pending
        self.gate.open = False
        self.gate.settle = self._settle_from_gate
        self.comm.stats.weight_gather_issued()

    def _settle_from_gate(self) -> None:
        self.wait_weights()

    def wait_weights(self, *, in_forward: bool = False) -> bool:
        """Wait on the pending weight all-gather, if any (idempotent).

        Args:
            in_forward: the wait is the unit's own pre-forward one (counted apart).

        Returns:
            Whether there was one to wait on.
        """
        pending = self.pending_weights
        if pending is None:
            return False
        self.pending_weights = None
        pending.wait()
        self.gate.settle = None
        self.gate.open = True
        self.comm.stats.weight_gather_waited(in_forward=in_forward)
        return True

    def push_main_weights(self) -> PendingCollective | None:
        """Copy updated fp32 main weights into the compute weights (gather if needed).

        Waits first on a weight all-gather still pending from the last step, which writes
        the same buffers.
        """
        self.wait_weights()
        same = self.compute_dtype == torch.float32
        with torch.no_grad():
            if self.strategy.shards_params:
                if not same:
                    assert self.param_shard is not None
                    self.param_shard.copy_(self.main_weight)
                return None
            if not self.strategy.shards_optimizer:
                if not same:
                    self.full_param.copy_(self.main_weight)
                return None
            # The own slice may alias `main_weight`; a separate input keeps gloo's copy sane.
            shard = self.main_weight.to(self.compute_dtype, copy=True)
            return self.comm.all_gather(self.full_param, shard)
