"""`DistributedOptimizer`: a torch optimizer over this rank's fp32 main-weight shards.

Each bucket's main weights (its shard, or the whole bucket under `NO_SHARD`) are handed to
the torch optimizer as contiguous chunks of `CHUNK_NUMEL` elements whose `.grad` are the
matching chunks of the reduced fp32 gradient. Chunks, not per-parameter tensors, keep the
Python work per step small; chunks, not one flat tensor per bucket, keep each update's
working set in cache (AdamW over 13M elements: 235 ms flat, 53 ms in 256K chunks, one CPU
thread). This suits elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...);
optimizers that look at a parameter's shape or norm (LAMB, Adafactor) would see chunks.

With parameter groups (`_groups.py`), chunks are cut at group boundaries and each torch
parameter group holds the chunks of one user group, so per-group hyperparameters apply per
element range even where a rank's shard spans parameters of several groups.

The optimizer's sharded state dict is per parameter, not per chunk: each elementwise state
tensor becomes `ShardedTensor` pieces in the model's flat form (`_state_dict.py`), so it
reshards on load exactly like the weights.

With a `loss_scale` in the mixed-precision policy the optimizer owns a `ShardedLossScaler`
(`_scaler.py`): `scale_loss` multiplies the loss, `clip_grad_norm_` / `step` unscale once,
an overflow anywhere skips the step on every rank, and the scale is saved under
`"loss_scaler"` in the state dict.

[Note: deferred weight gather] Under `OPTIM` / `OPTIM_GRADS` each rank updates only its shard
of the fp32 main weights, and the compute weights every rank uses are refreshed by one
all-gather per bucket. `step()` issues them and returns; each bucket keeps its pending
gather (`FlatBucket.pending_weights`, its gate closed) until a reader waits on it
(`Engine.wait_pending_weights`, idempotent). The next forward waits per unit just before
that unit runs (the root unit's in the wrapper's pre-forward), so the first units compute
while later units' gathers are still in flight. Every other reader waits first: a checked
read of a parameter (the gate's `settle`; the wrapper's forward keeps the checks on while
a gather is pending, so code reading another unit's weight early waits too), the model's
`state_dict` / `sharded_state_dict` / `full_state_dict` / `load_sharded_state_dict`,
`summon_full_params`, backward (a unit that skipped forward) and the next `step` (it
writes main weights that may alias the compute weights being filled). `zero_grad` does
not wait: it touches gradients only, and it sits between `step` and the next forward in
every training loop. Eval forwards (`no_grad`) and `no_sync` micro-batches wait exactly
like training forwards. On CUDA the wait is a stream wait ([Note: streams and lifetimes]
in `_comm.py`); on CPU gloo runs the gather on its own threads, so it overlaps there too.
`NO_SHARD` and `OPTIM_GRADS_PARAMS` have nothing to gather after a step.
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from sharding._engine import Engine
from sharding._groups import group_runs, resolve_groups
from sharding._optimizer_state import check_uniform_entries, materialize_state
from sharding._scaler import ShardedLossScaler
from sharding._state_dict import (
    ShardedTensor,
    StateDict,
    as_pieces,
    complete_replicated,
    fill,
    local_of,
    piece_bounds,
)
from sharding.errors import StateDictLayoutError

__all__ = [
    "CHUNK_NUMEL",
    "DistributedOptimizer",
    "load_optimizer_sharded_state_dict",
    "optimizer_sharded_state_dict",
]

CHUNK_NUMEL = 1 << 18
GROUP_NAMES_KEY = "param_names"
"""Key of each saved parameter group's list of parameter names (checked on load)."""
LOSS_SCALER_KEY = "loss_scaler"
"""Key of the loss scaler's state (scale, growth tracker) when the policy has one."""


class DistributedOptimizer:
    """Steps a torch optimizer on main-weight shards and pushes the result to the model."""

    def __init__(
        self,
        engine: Engine,
        optimizer_class: type[torch.optim.Optimizer],
        param_groups: Iterable[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        """Build `optimizer_class(chunk groups, **kwargs)`; use `make_optimizer`.

        Args:
            engine: the wrapper's engine.
            optimizer_class: a `torch.optim.Optimizer` subclass.
            param_groups: torch-style groups (see `FullyShardedDataParallel.make_optimizer`);
                `None` for one group of every trained parameter.
            **kwargs: default hyperparameters (`lr`, `weight_decay`, ...).

        Raises:
            ValueError: a group lists an unknown parameter or one twice, or misses one.
            ShardingError: groups keep different per-element state (e.g. `amsgrad` in some
                groups only; [Note: one set of state entries per optimizer]).
        """
        self._engine = engine
        self.buckets = [b for b in engine.buckets if b.trains]
        groups, owner = resolve_groups(self.buckets, param_groups)
        # (bucket position, start, end, group) of every optimizer tensor, in main-weight
        # coordinates, in bucket order; chunks never cross a group boundary.
        self.chunks: list[tuple[int, int, int, int]] = [
            (pos, start, min(start + CHUNK_NUMEL, e), group)
            for pos, b in enumerate(self.buckets)
            for a, e, group in group_runs(b, pos, owner)
            for start in range(a, e, CHUNK_NUMEL)
        ]
        self.params = [self.buckets[pos].main_weight[a:e] for pos, a, e, _ in self.chunks]
        # Chunks are in bucket order: bucket `pos` owns `self.chunks[lo:hi]`, so a bucket's
        # lookup costs its own chunks, not every chunk of the model (26K for 7B parameters).
        self._chunk_spans = [
            (bisect.bisect_left(self.chunks, (pos,)), bisect.bisect_left(self.chunks, (pos + 1,)))
            for pos in range(len(self.buckets))
        ]
        self.group_names: list[list[str]] = [[] for _ in groups]
        """First name of every parameter in each group (saved with the state dict)."""
        for (pos, index), group in sorted(owner.items()):
            self.group_names[group].append(self.buckets[pos].layout.slots[index].names[0])
        torch_groups = [
            {
                **hyper,
                "params": [p for p, c in zip(self.params, self.chunks, strict=True) if c[3] == g],
            }
            for g, hyper in enumerate(groups)
        ]
        self.optimizer: torch.optim.Optimizer = optimizer_class(torch_groups, **kwargs)
        """The underlying torch optimizer (give it to LR schedulers); one group per user group."""
        # [Note: one set of state entries per optimizer] in `_optimizer_state.py`.
        check_uniform_entries(self.optimizer, [n[0] if n else "" for n in self.group_names])
        loss_scale = engine.config.precision.loss_scale
        self.loss_scaler = (
            ShardedLossScaler(loss_scale, engine.comm) if loss_scale is not None else None
        )
        """The dynamic loss scaler (`None` unless the policy has `loss_scale`)."""
        self.last_step_skipped = False
        """Whether the last `step()` was skipped because a gradient overflowed (loss scaling)."""
        self._adjacent_marker: weakref.ref[torch.Tensor] | None = None
        self._pieces: dict[int, _KeptPieces] = {}
        # [Note: saved pieces are made once]: by bucket position; dropped with the state.
        # [Note: a bucket's optimizer state in one storage]: the first chunk's first state
        # tensor when every chunk's state was last checked (or moved) to lie end to end; a
        # state replaced since (a load, `state.clear()` and a step) has another.

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call `.backward()` on: multiplied by the loss scale when there is one.

        Always correct to use (it returns `loss` itself without loss scaling); required when
        the mixed-precision policy has `loss_scale` (fp16).
        """
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def _settled_grads(self) -> list[torch.Tensor]:
        """Every trained bucket's real, unscaled gradient (unscaling checks for overflow)."""
        self._engine.check_no_stray_grads()
        for bucket in self.buckets:
            bucket.settle_grad()
        grads = [g for b in self.buckets if (g := b.optimizer_grad()) is not None]
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(grads)
        return grads

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's parameter groups."""
        return self.optimizer.param_groups

    def _link_grads(self) -> None:
        grads = [b.optimizer_grad() for b in self.buckets]
        for param, (pos, a, e, _) in zip(self.params, self.chunks, strict=True):
            grad = grads[pos]
            assert grad is not None
            param.grad = grad[a:e]

    def bucket_chunks(self, pos: int) -> list[tuple[int, int, dict[str, Any]]] | None:
        """The torch state of bucket `pos`'s chunks: `(start, end, state)` in main-weight
        coordinates, ascending, tiling its main weights (None: no state yet)."""
        out: list[tuple[int, int, dict[str, Any]]] = []
        lo, hi = self._chunk_spans[pos]
        for chunk, param in zip(self.chunks[lo:hi], self.params[lo:hi], strict=True):
            state = self.optimizer.state.get(param)
            if not state:
                return None
            out.append((chunk[1], chunk[2], state))
        return out or None

    def _make_state_adjacent(self) -> None:
        """Move each bucket's elementwise state into one tensor per key, chunks as its views.

        [Note: a bucket's optimizer state in one storage] torch creates each chunk's state
        tensors on their own (`zeros_like` at the first step), so a parameter spanning chunks
        (any over `CHUNK_NUMEL` elements: most of a real model's) had pieces that
        `sharded_state_dict` had to concatenate: a copy of nearly all optimizer state on the
        caller's thread at every call, which the memory tier makes at every snapshot (6.4 ms
        of a 134 MB rank's 8.6 ms stall, `bench/snapshot_stall.py --state-mib 128`). Once
        each key's chunks are views of one tensor, end to end in chunk order, every piece is a
        view (`_state_range`) and a snapshot copies the state once, into its slab; and the
        pieces, all views, are made once ([Note: saved pieces are made once]). Done once after
        the first step that created state and after a load; the chunks keep their shapes and
        values, each update still runs on a chunk (the cache-sized working set).
        """
        marker = self._state_marker()
        if marker is None or (
            self._adjacent_marker is not None and self._adjacent_marker() is marker
        ):
            return  # no state yet (a skipped first step), or checked since it was made
        self._pieces.clear()  # pieces of a state replaced since (they hold its storage)
        for pos in range(len(self.buckets)):
            chunks = self.bucket_chunks(pos)
            if chunks is None:
                return  # not every bucket has state yet: checked again after the next step
            base = chunks[0][0]
            for key, value in chunks[0][2].items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    continue
                tensors = [s[key] for _, _, s in chunks]
                if _end_to_end(tensors):
                    continue  # one tensor already (a load makes them views of one)
                flat = torch.empty(chunks[-1][1] - base, dtype=value.dtype, device=value.device)
                for start, end, state in chunks:
                    view = flat[start - base : end - base].view_as(state[key])
                    view.copy_(state[key])
                    state[key] = view
        moved = self._state_marker()
        self._adjacent_marker = weakref.ref(marker if moved is None else moved)

    def _state_marker(self) -> torch.Tensor | None:
        """The first chunk's first elementwise state tensor (None: no state yet)."""
        state = self.optimizer.state.get(self.params[0]) if self.params else None
        for value in (state or {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return value
        return None

    def bucket_state(self, pos: int) -> dict[str, Any] | None:
        """The optimizer state of bucket `pos` as flat main-weight-shaped tensors (copies)."""
        chunks = self.bucket_chunks(pos)
        if chunks is None:
            return None
        out: dict[str, Any] = {}
        for key, value in chunks[0][2].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[key] = torch.cat([s[key].reshape(-1) for _, _, s in chunks])
            else:
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return out

    def chunk_state(self, flat: dict[str, Any], index: int) -> dict[str, Any]:
        """Slice one chunk's torch state out of a bucket's flat state."""
        _, a, e, _ = self.chunks[index]
        # Scalar tensors (Adam's `step`) are cloned too: torch updates them in place, so
        # chunks sharing one tensor would advance it once per chunk.
        # Elementwise state stays a view of `flat` ([Note: a bucket's optimizer state in one
        # storage]): chunks of one bucket do not overlap.
        return {
            key: (value[a:e] if value.dim() > 0 else value.clone())
            if isinstance(value, torch.Tensor)
            else value
            for key, value in flat.items()
        }

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm (across all shards) is at most `max_norm`.

        Args:
            max_norm: largest allowed norm.
            norm_type: the p of the p-norm (`math.inf` for the max norm).

        Returns:
            The global norm before clipping, a float32 scalar tensor (of the unscaled
            gradients; inf when loss scaling found an overflow, and the step will be skipped).
        """
        grads = self._settled_grads()
        sharded = self._engine.config.strategy.shards_optimizer
        device = self._engine.comm.device
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else None
            value = local if local is not None else torch.zeros((), device=device)
            if sharded and self._engine.comm.distributed:
                import torch.distributed as dist

                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._engine.comm.group)
            total = value.float()
        else:
            powers = [torch.linalg.vector_norm(g, norm_type) ** norm_type for g in grads]
            local_sum = torch.stack(powers).sum() if powers else torch.zeros((), device=device)
            if sharded:
                local_sum = self._engine.comm.sum_scalar(local_sum)
            total = (local_sum ** (1.0 / norm_type)).float()
        if self.loss_scaler is not None and self.loss_scaler.found_inf:
            # The step will be skipped; a NaN coefficient would also poison the alignment gaps
            # of NO_SHARD's persistent gradient, which later steps never overwrite.
            return total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on the shards, then start refreshing the model's weights.

        Under `OPTIM` / `OPTIM_GRADS` the all-gathers of the updated weights are issued and
        left running: each unit's pre-forward of the next forward waits on its own, and any
        other reader (a parameter read, state dicts, `summon_full_params`, the next step)
        waits first ([Note: deferred weight gather]).

        With loss scaling, a step whose gradients overflowed on any rank is skipped on every
        rank (`last_step_skipped`) and the scale backs off.

        Raises:
            ShardingError: loss scaling is on and the loss was not passed to `scale_loss`.
        """
        # The optimizer writes the main weights, which may alias the compute weights that the
        # last step's gathers still fill; and those gathers must finish before new ones.
        self._engine.wait_pending_weights()
        self._settled_grads()
        scaler = self.loss_scaler
        self.last_step_skipped = scaler is not None and scaler.found_inf
        if scaler is not None:
            scaler.update()
        if self.last_step_skipped:
            # A skipped step is still a step for the queue-depth peaks.
            self._engine.stats.end_step()
            return
        self._link_grads()
        self.optimizer.step()
        self._make_state_adjacent()
        # [Note: deferred weight gather]: not waited here; the next forward waits per unit.
        # Issued in the order it waits (the root unit first): a process group runs its
        # collectives in issue order, so the first wait must not queue behind the others.
        for bucket in self._engine.buckets_in_forward_order():
            bucket.refresh_weights()
        self._engine.stats.end_step()  # [Note: queue depth per step] in sharding/_stats.py

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the main gradients (the next reduction overwrites them, no memset)."""
        del set_to_none
        for param in self.params:
            param.grad = None
        for bucket in self._engine.buckets:
            bucket.zero_grad()

    def sharded_state_dict(self) -> StateDict:
        """This rank's optimizer state: per parameter, `ShardedTensor` pieces of each state.

        Returns:
            `{"state": {name: {key: ShardedTensor | Tensor | value}}, "param_groups": [...]}`;
            each group holds its hyperparameters and `"param_names"` (its parameters).
        """
        return optimizer_sharded_state_dict(self)

    def materialize_state(self) -> bool:
        """Give the torch optimizer the state its first step would, without a step.

        For a restore template: `sharded_state_dict()` then has the optimizer's entries, as
        views of the live state, and `load_sharded_state_dict` of the pieces a restore filled
        in place keeps the state where it is ([Note: optimizer state made for a restore]).
        No weight moves, no RNG is drawn, no collective runs; if nothing is loaded after all
        and it returned True, `optimizer.state.clear()` leaves a fresh optimizer.

        Returns:
            True if it made the state, False if the optimizer had state already (a step, a
            load, or one that makes its state when built, as Adagrad): nothing changed.

        Raises:
            ShardingError: some chunks have state and others none.
        """
        made = materialize_state(self.optimizer, self.params, self.chunks)
        self._pieces.clear()
        # As a step leaves it: records the layout made (one tensor per key per bucket), or
        # moves a state the optimizer made when built (Adagrad's, per chunk) into it.
        self._make_state_adjacent()
        return made

    def load_sharded_state_dict(self, state_dict: StateDict) -> None:
        """Load state saved by `sharded_state_dict` (any world size, any strategy).

        Raises:
            StateDictLayoutError: pieces are missing or have the wrong shape.
        """
        load_optimizer_sharded_state_dict(self, state_dict)


def _is_piece(value: Any) -> bool:
    return hasattr(value, "local") and hasattr(value, "global_shape")


def _is_elementwise(value: Any) -> bool:
    """Whether a saved optimizer-state value is a (piece of a) per-element tensor."""
    pieces = as_pieces(value)
    return any(_is_piece(p) or (isinstance(p, torch.Tensor) and p.dim() > 0) for p in pieces)


def _json_group(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}


def optimizer_sharded_state_dict(opt: DistributedOptimizer) -> StateDict:
    """Per parameter and state key: `ShardedTensor` pieces (elementwise state) or values.

    [Note: optimizer pieces are views] A piece that lies inside one optimizer chunk (every
    piece of a parameter under `CHUNK_NUMEL` elements, most of the others) is a view of the
    torch optimizer's state tensor, as the model's pieces are views of the main weights; only
    a piece spanning chunks is concatenated. Concatenating every bucket's state first, as
    before, copied all of the optimizer state on the caller's thread at each call: the memory
    tier calls this on the training thread at every snapshot and copies the pieces itself
    (0.4 of the 1 ms this took for the default job). A piece spanning chunks is one view
    too once the bucket's state lies in one storage ([Note: a bucket's optimizer state in one
    storage], after the first step). A caller that keeps the pieces across `step()` copies
    them (the checkpoint manager's `save()` does, before its fence).
    Scalar state (Adam's `step`) is cloned as before: torch updates it in place.
    """
    state: dict[str, dict[str, Any]] = {}
    for pos, bucket in enumerate(opt.buckets):
        chunks = opt.bucket_chunks(pos)
        if chunks is None:
            continue
        first = chunks[0][2]
        scalars = {
            key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in first.items()
            if not (isinstance(value, torch.Tensor) and value.dim() > 0)
        }
        keys = [key for key in first if key not in scalars]
        pieces = _state_pieces(opt._pieces, pos, bucket, chunks, keys)
        for slot, by_key in zip(bucket.layout.slots, pieces, strict=True):
            state[slot.names[0]] = {
                key: by_key[key] if key not in scalars else scalars[key] for key in first
            }
    groups = opt.optimizer.state_dict()["param_groups"]
    out: StateDict = {
        "state": state,
        "param_groups": [
            {**_json_group(g), GROUP_NAMES_KEY: list(names)}
            for g, names in zip(groups, opt.group_names, strict=True)
        ],
    }
    if opt.loss_scaler is not None:
        out[LOSS_SCALER_KEY] = opt.loss_scaler.state_dict()
    return out


_KeptPieces = tuple[list["weakref.ref[torch.Tensor]"], list[dict[str, ShardedTensor]]]
"""A bucket's pieces, with weak references to the chunk tensors they were cut from."""


def _state_pieces(
    kept: dict[int, _KeptPieces],
    pos: int,
    bucket: Any,
    chunks: list[tuple[int, int, dict[str, Any]]],
    keys: list[str],
) -> list[dict[str, ShardedTensor]]:
    """Per slot of bucket `pos`, the `ShardedTensor` of each elementwise state key.

    [Note: saved pieces are made once] (`_state_dict.py`) for the optimizer: pieces that are
    all views are kept in `kept` with weak references to every chunk tensor they were cut
    from, and served again while those are the state's tensors. The optimizer drops them
    when its state is replaced (a load; `state.clear()` by the next step's check), so they
    never hold a replaced state's storage beyond one step. Not on the tensors themselves: an
    attribute of a torch tensor is pickled with it (`torch.save` of the torch optimizer's
    state would carry these objects, and `torch.load(weights_only=True)` refuse them).
    Pieces with a concatenated copy among them (state not yet in one storage) are made anew
    at each call.
    """
    tensors = [state[key] for _, _, state in chunks for key in keys]
    if not tensors:
        return [{} for _ in bucket.layout.slots]
    cached = kept.get(pos)
    if (
        cached is not None
        and len(cached[0]) == len(tensors)
        and all(ref() is t for ref, t in zip(cached[0], tensors, strict=True))
    ):
        return cached[1]
    starts = [start for start, _, _ in chunks]
    base = 0 if bucket.main_weight.numel() == bucket.layout.padded_numel else bucket.start
    copied = False
    pieces: list[dict[str, ShardedTensor]] = []
    for slot in bucket.layout.slots:
        lo, hi = piece_bounds(bucket, slot)
        offset = max(lo - slot.offset, 0)
        by_key = {}
        for key in keys:
            local, is_copy = _state_range(chunks, starts, key, lo - base, hi - base)
            copied = copied or is_copy
            by_key[key] = ShardedTensor(
                local=local,
                global_shape=tuple(slot.shape),
                global_offset=(0,) * len(slot.shape),
                flat_range=(offset, offset + (hi - lo)),
            )
        pieces.append(by_key)
    if copied:
        kept.pop(pos, None)
    else:
        kept[pos] = ([weakref.ref(t) for t in tensors], pieces)
    return pieces


def _state_range(
    chunks: list[tuple[int, int, dict[str, Any]]], starts: list[int], key: str, a: int, e: int
) -> tuple[torch.Tensor, bool]:
    """Elements `[a, e)` (main-weight coordinates) of state `key`, and whether they are a copy:
    a view of one chunk's tensor or of several in one storage, else the parts of several
    concatenated ([Note: optimizer pieces are views])."""
    first = max(bisect.bisect_right(starts, a) - 1, 0)
    if a >= e:
        return chunks[first][2][key].reshape(-1)[:0], False
    parts = []
    for start, end, chunk_state in chunks[first:]:
        if start >= e:
            break
        parts.append(chunk_state[key].reshape(-1)[max(a, start) - start : min(e, end) - start])
    if len(parts) == 1:
        return parts[0], False
    if _end_to_end(parts):
        # One view over the chunks ([Note: a bucket's optimizer state in one storage]).
        return parts[0].as_strided((e - a,), (1,)), False
    return torch.cat(parts), True


def _restored_in_place(
    opt: DistributedOptimizer, pos: int, entries: list[Any]
) -> dict[str, torch.Tensor] | None:
    """Bucket `pos`'s state tensors, main-weight-shaped, one per elementwise key, when every
    elementwise entry of the loaded `entries` (per slot) is the very piece this optimizer
    served for it (`restore(into=...)` of a template it made filled the live state); else None.

    Only where the bucket's state lies in one storage per key and its chunks tile the main
    weights (the flat tensor the load would have built is then a view of the live state).
    """
    cached = opt._pieces.get(pos)
    chunks = opt.bucket_chunks(pos)
    if cached is None or chunks is None or not entries:
        return None
    keys = list(cached[1][0]) if cached[1] else []
    tensors = [state[key] for _, _, state in chunks for key in keys]
    if not keys or len(cached[0]) != len(tensors):
        return None
    if not all(ref() is t for ref, t in zip(cached[0], tensors, strict=True)):
        return None
    for entry, pieces in zip(entries, cached[1], strict=True):
        if entry is None or any(entry.get(key) is not pieces[key] for key in keys):
            return None
    numel = opt.buckets[pos].main_weight.numel()
    if chunks[0][0] != 0 or chunks[-1][1] != numel:
        return None
    flats = {}
    for key in keys:
        parts = [state[key] for _, _, state in chunks]
        if not _end_to_end(parts):
            return None
        flats[key] = parts[0].as_strided((numel,), (1,))
    return flats


def _end_to_end(tensors: list[torch.Tensor]) -> bool:
    """Whether contiguous tensors lie end to end in one storage, in list order."""
    storage = tensors[0].untyped_storage().data_ptr()
    end = tensors[0].data_ptr()
    for tensor in tensors:
        if (
            not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage
            or tensor.data_ptr() != end
        ):
            return False
        end += tensor.numel() * tensor.element_size()
    return True


def load_optimizer_sharded_state_dict(opt: DistributedOptimizer, state_dict: StateDict) -> None:
    """Rebuild the torch optimizer's chunked state from per-parameter pieces."""
    if opt.loss_scaler is not None and LOSS_SCALER_KEY in state_dict:
        # A checkpoint without it (saved without loss scaling) keeps the initial scale.
        opt.loss_scaler.load_state_dict(state_dict[LOSS_SCALER_KEY])
    saved_state: dict[str, dict[str, Any]] = state_dict.get("state", {})
    groups: Sequence[dict[str, Any]] = state_dict.get("param_groups", [])
    current = opt.optimizer.state_dict()
    if len(groups) != len(current["param_groups"]):
        raise StateDictLayoutError(
            f"optimizer state has {len(groups)} parameter groups, this optimizer has "
            f"{len(current['param_groups'])}; build it with make_optimizer like the saved one"
        )
    for g, (saved, names) in enumerate(zip(groups, opt.group_names, strict=True)):
        # Checkpoints from before groups were saved have no names; they had one group.
        if GROUP_NAMES_KEY in saved and list(saved[GROUP_NAMES_KEY]) != names:
            raise StateDictLayoutError(
                f"optimizer parameter group {g} held other parameters when saved "
                f"({len(saved[GROUP_NAMES_KEY])} vs {len(names)} now); build the optimizer "
                "with the same param_groups as the saved one"
            )
    flat_states: dict[int, dict[str, Any]] = {}
    for pos, bucket in enumerate(opt.buckets):
        entries = [saved_state.get(s.names[0]) for s in bucket.layout.slots]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries):
            raise StateDictLayoutError(
                f"optimizer state covers only some parameters of bucket {pos}; it must "
                "hold either every trained parameter or none"
            )
        flat_state: dict[str, Any] = {}
        kept = _restored_in_place(opt, pos, entries)
        for key in entries[0] or {}:
            values = [entry[key] for entry in entries if entry is not None]
            if kept is not None and key in kept:
                # [Note: optimizer state made for a restore]: filled where it lives.
                complete_replicated(bucket, kept[key])
                flat_state[key] = kept[key]
                continue
            if not _is_elementwise(values[0]):
                first = as_pieces(values[0])[0]
                flat_state[key] = first.clone() if isinstance(first, torch.Tensor) else first
                continue
            flat = torch.zeros_like(bucket.main_weight)
            for slot, value in zip(bucket.layout.slots, values, strict=True):
                lo, hi = piece_bounds(bucket, slot)
                dst = local_of(bucket, flat, lo, hi)
                start = max(lo - slot.offset, 0)
                fill(dst, start, f"{slot.names[0]}.{key}", slot.shape, value)
            complete_replicated(bucket, flat)
            flat_state[key] = flat
        flat_states[pos] = flat_state
    # torch numbers parameters group by group, not in chunk (bucket) order.
    torch_index = {
        id(p): i for i, p in enumerate(p for g in opt.optimizer.param_groups for p in g["params"])
    }
    new_state = {
        torch_index[id(opt.params[index])]: opt.chunk_state(flat_states[pos], index)
        for index, (pos, _, _, _) in enumerate(opt.chunks)
        if pos in flat_states
    }
    new_groups = []
    for saved, cur in zip(groups, current["param_groups"], strict=True):
        group = {k: v for k, v in saved.items() if k != GROUP_NAMES_KEY}
        if isinstance(cur.get("betas"), tuple) and isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
        group["params"] = cur["params"]
        new_groups.append(group)
    opt.optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
    opt._make_state_adjacent()  # new state tensors: the kept pieces go there too
