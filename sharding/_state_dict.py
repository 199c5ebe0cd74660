"""Sharded and full state dicts, and resharding on load.

The engine emits the neutral flat form (CONTRACTS.md): one `ShardedTensor` per parameter
(first name of tied parameters) holding this rank's elements `[start, end)` of the flattened
fp32 main weight, possibly none. Pieces are views of live buffers; a checkpointer copies
them before the next optimizer step. Module buffers are copies taken at the call: a training
forward changes them in place (BatchNorm's running statistics, a buffer broadcast), and it
runs before that step ([Note: buffers are copied into the state dict]). Loading accepts, per
key, a piece with exactly this rank's range, the whole tensor, or a list of pieces from any
layout (e.g. every rank's pieces of a checkpoint written at another world size or strategy)
that covers the range.

The model's state dicts live here; the optimizer's (`sharding/_optimizer.py`) use the same
piece helpers (`shard_of` to save, `piece_bounds` / `local_of` / `fill` /
`complete_replicated` to load), so this module never needs the optimizer.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from sharding._buffer import FlatBucket
from sharding._layout import ParamSlot
from sharding.errors import StateDictLayoutError

__all__ = [
    "ALIASES_KEY",
    "ShardedTensor",
    "StateDict",
    "as_pieces",
    "complete_replicated",
    "fill",
    "full_state_dict",
    "load_model_sharded_state_dict",
    "local_of",
    "model_sharded_state_dict",
    "piece_bounds",
    "shard_of",
]

StateDict = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ShardedTensor:
    """A rank's piece of a larger tensor (the neutral form of CONTRACTS.md)."""

    local: torch.Tensor
    """This rank's elements (1-D in the flat form; may be empty)."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    global_offset: tuple[int, ...]
    """N-D offset of `local` in the whole (all zeros and ignored in the flat form)."""
    flat_range: tuple[int, int] | None
    """Elements `[start, end)` of the row-major flattened whole that `local` holds."""


def piece_bounds(bucket: FlatBucket, slot: ParamSlot) -> tuple[int, int]:
    """Bucket range of `slot` this rank saves and loads (empty, at the slot's start, if none).

    An empty piece is placed inside the parameter so its `flat_range` is `(0, 0)`: a range
    past the parameter's end would describe a position the tensor does not have. Under
    hybrid sharding only replica 0 has pieces ([Note: replicated state is saved once]).
    """
    if not bucket.saves_pieces:
        return slot.offset, slot.offset
    lo = max(slot.offset, bucket.start)
    hi = min(slot.offset + slot.numel, bucket.end)
    return (lo, hi) if lo < hi else (slot.offset, slot.offset)


def local_of(bucket: FlatBucket, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Slice bucket range `[lo, hi)` out of a main-weight-shaped tensor."""
    if lo == hi:
        return flat[:0]
    base = 0 if flat.numel() == bucket.layout.padded_numel else bucket.start
    return flat[lo - base : hi - base]


def complete_replicated(bucket: FlatBucket, flat: torch.Tensor) -> None:
    """Fill the ranges this rank holds but did not load (collective).

    [Note: replicated state is saved once] `no_shard` keeps whole main weights and optimizer
    state on every rank, but each rank saves (and so loads) only the range it owns, so a
    checkpoint holds every element once. After loading its own range, a rank gathers the
    others' from its peers; every rank calls this for the same buckets in the same order.
    Hybrid sharding ([Note: hybrid layout] in `_mesh.py`) holds each shard once per shard
    group: replica 0 saves it, the other replicas save empty pieces (`flat_range` `(0, 0)`,
    so the checkpoint holds what one shard group holds), and on load they take replica 0's
    shard by a broadcast over the replica group.
    """
    if bucket.comm.num_replicas > 1:
        bucket.comm.broadcast_replicas_(flat)
        return
    whole = flat.numel() == bucket.layout.padded_numel
    if not whole or (bucket.start == 0 and bucket.end == flat.numel()):
        return
    own = flat[bucket.start : bucket.end]
    if bucket.comm.gathers_in_place:
        bucket.comm.all_gather(flat, own).wait()  # no full-size temporary, no copy back
        return
    full = torch.empty_like(flat)
    bucket.comm.all_gather(full, own.contiguous()).wait()
    flat.copy_(full)


def shard_of(bucket: FlatBucket, slot: ParamSlot, flat: torch.Tensor) -> ShardedTensor:
    """This rank's piece of `slot` in a main-weight-shaped tensor (a view, not a copy)."""
    lo, hi = piece_bounds(bucket, slot)
    start = max(lo - slot.offset, 0)
    return ShardedTensor(
        local=local_of(bucket, flat, lo, hi).detach(),
        global_shape=tuple(slot.shape),
        global_offset=(0,) * len(slot.shape),
        flat_range=(start, start + (hi - lo)),
    )


def as_pieces(value: Any) -> list[Any]:
    """A saved value as a list of pieces (a list or tuple as given, anything else alone)."""
    return list(value) if isinstance(value, list | tuple) else [value]


def fill(dst: torch.Tensor, start: int, key: str, shape: torch.Size, value: Any) -> None:
    """Copy elements `[start, start + dst.numel())` of the flattened `key` out of `value`."""
    end = start + dst.numel()
    covered = 0
    for piece in as_pieces(value):
        if isinstance(piece, torch.Tensor):
            if piece.shape != shape:
                raise StateDictLayoutError(
                    f"{key!r}: saved shape {tuple(piece.shape)} != model shape {tuple(shape)}"
                )
            dst.copy_(piece.reshape(-1)[start:end])
            covered = dst.numel()
            continue
        global_shape = tuple(getattr(piece, "global_shape", ()))
        if global_shape != tuple(shape):
            raise StateDictLayoutError(
                f"{key!r}: saved global shape {global_shape} != model shape {tuple(shape)}"
            )
        local = piece.local
        flat_range = piece.flat_range
        if flat_range is None:
            if local.shape != shape:
                raise StateDictLayoutError(
                    f"{key!r}: a box-form piece of shape {tuple(local.shape)} at offset "
                    f"{piece.global_offset} is not supported; pass the whole tensor"
                )
            flat_range = (0, shape.numel())
        a, b = max(flat_range[0], start), min(flat_range[1], end)
        if a < b:
            dst[a - start : b - start].copy_(
                local.reshape(-1)[a - flat_range[0] : b - flat_range[0]]
            )
            covered += b - a
    if covered < dst.numel():
        raise StateDictLayoutError(
            f"{key!r}: this rank needs elements [{start}, {end}) but the state dict covers only "
            f"{covered} of them: it was saved at another world size or strategy; pass every "
            "rank's pieces for the key (a list) or the whole tensor, e.g. via "
            "ckpt_manager's restore"
        )


ALIASES_KEY = "__aliases__"
"""Key of `{tied name: first name}` in a model's sharded state dict (CONTRACTS.md): a tied
parameter is saved once, and exports use this to give the plain module every name it has."""


_WEIGHT_PIECES: weakref.WeakKeyDictionary[FlatBucket, tuple[torch.Tensor, list[ShardedTensor]]] = (
    weakref.WeakKeyDictionary()
)


def _weight_pieces(bucket: FlatBucket) -> list[ShardedTensor]:
    """Each slot's `shard_of` the bucket's main weights, made once per main-weight tensor.

    [Note: saved pieces are made once] A piece is a view with fixed bounds (the layout, the
    shard range and the replica role never change), and a `ShardedTensor` is frozen, so the
    same objects serve every call: the memory tier asks at every snapshot, on the training
    thread, and a new view per parameter was a third of the model's state-dict time.
    """
    cached = _WEIGHT_PIECES.get(bucket)
    if cached is not None and cached[0] is bucket.main_weight:
        return cached[1]
    pieces = [shard_of(bucket, slot, bucket.main_weight) for slot in bucket.layout.slots]
    _WEIGHT_PIECES[bucket] = (bucket.main_weight, pieces)
    return pieces


def model_sharded_state_dict(
    buckets: list[FlatBucket], buffers: dict[str, torch.Tensor]
) -> StateDict:
    """Per parameter this rank's `ShardedTensor` of the fp32 main weight; buffers whole.

    Tied parameters appear once, under their first name; `ALIASES_KEY` maps the others to it.

    [Note: buffers are copied into the state dict] A checkpointer copies the state in the
    background until the next optimizer step (its fence: weights change only there), while
    the next forward and backward run. A training forward changes buffers in place
    (BatchNorm's running statistics; `BufferSync.BROADCAST` overwrites them before it), so a
    buffer handed out as a view was copied partly before and partly after that forward: a
    snapshot that no uninterrupted run ever held. Buffers are small next to the weights and
    the optimizer state; each is cloned here, on the training thread's stream.
    """
    out: StateDict = {}
    aliases: dict[str, str] = {}
    for bucket in buckets:
        for slot, piece in zip(bucket.layout.slots, _weight_pieces(bucket), strict=True):
            out[slot.names[0]] = piece
            aliases.update((name, slot.names[0]) for name in slot.names[1:])
    for name, buf in buffers.items():
        out[name] = buf.detach().clone()
    if aliases:
        out[ALIASES_KEY] = aliases
    return out


def load_model_sharded_state_dict(
    buckets: list[FlatBucket],
    buffers: dict[str, torch.Tensor],
    state_dict: StateDict,
    ignored: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Write main weights (and buffers) from `state_dict`; the caller refreshes model weights.

    `ALIASES_KEY` (tied names) is optional and not checked: ties come from the module. Keys
    in `ignored` (the module's non-persistent buffers, which checkpoints written before they
    were left out still hold) are skipped: the module rebuilds those itself.
    """
    expected = {s.names[0] for b in buckets for s in b.layout.slots} | set(buffers)
    given = set(state_dict) - {ALIASES_KEY} - set(ignored)
    missing = sorted(expected - given)
    unexpected = sorted(given - expected)
    if missing or unexpected:
        raise StateDictLayoutError(
            f"state dict does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (keys are the unwrapped module's parameter names)"
        )
    with torch.no_grad():
        for bucket in buckets:
            for slot in bucket.layout.slots:
                lo, hi = piece_bounds(bucket, slot)
                dst = local_of(bucket, bucket.main_weight, lo, hi)
                fill(
                    dst,
                    max(lo - slot.offset, 0),
                    slot.names[0],
                    slot.shape,
                    state_dict[slot.names[0]],
                )
            complete_replicated(bucket, bucket.main_weight)
        for name, buf in buffers.items():
            buf.copy_(as_pieces(state_dict[name])[0])


def full_state_dict(
    buckets: list[FlatBucket],
    names_in_order: list[str],
    buffers: dict[str, torch.Tensor],
    rank: int,
) -> StateDict:
    """Gather every parameter's fp32 main weight; on rank 0 return the plain module's dict.

    Values are CPU tensors in the parameters' original dtypes; tied names share one tensor.
    """
    values: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        weight = bucket.main_weight
        if weight.numel() != bucket.layout.padded_numel:
            full = torch.empty(bucket.layout.padded_numel, dtype=weight.dtype, device=weight.device)
            bucket.comm.all_gather(full, weight.contiguous()).wait()
            weight = full
        if rank != 0:
            continue
        for slot in bucket.layout.slots:
            tensor = weight[slot.offset : slot.offset + slot.numel].view(slot.shape)
            # Host copies: rank 0 must not hold a second model on the accelerator.
            tensor = tensor.to("cpu", slot.dtype, copy=True)
            for name in slot.names:
                values[name] = tensor
    if rank != 0:
        return {}
    out: StateDict = {}
    for name in names_in_order:
        if name in values:
            out[name] = values[name]
        elif name in buffers:
            out[name] = buffers[name].detach().to("cpu", copy=True)
    return out
