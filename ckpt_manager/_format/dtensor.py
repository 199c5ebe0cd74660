"""`torch.distributed.tensor.DTensor` leaves as the neutral sharded form (box pieces).

A DTensor leaf (FSDP2's `fully_shard` parameters and their AdamW state, tensor-parallel
weights) is saved as this rank's local shard, placed at its global offset: the same box
pieces a `ShardedTensorLike` gives, so restore reshards it at any world size or mesh and
`ckptctl` consolidates it. `Shard(dim)` (even or uneven, `torch.chunk` rule) and
`Replicate()` placements on any mesh are supported.

[Note: replicas write once] Along a mesh dimension whose placement is `Replicate()` every
coordinate holds the same data; only coordinate 0 writes it, the others contribute an empty
piece, so a 2-D (replicate, shard) mesh writes each shard once. Restore gives every replica
its region (pieces are deduplicated by region, so older steps written by every replica still
load).

`Partial()` (pending reduction) and `_StridedShard` (FSDP2 over TP, whose local shard is not
one box of the global tensor) are refused with a message saying what to do instead.

Nothing here imports `torch.distributed.tensor` unless a DTensor already exists in the
process: `is_dtensor` asks `sys.modules` first, so plain states pay one dict lookup.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from ckpt_manager._types import RankLocal

__all__ = ["DTensorPiece", "dtensor_piece", "is_dtensor", "unwrap_dtensors", "wrap_dtensors"]


@dataclasses.dataclass(frozen=True)
class DTensorPiece:
    """A DTensor seen as a `ShardedTensorLike` box piece (its local shard, in place)."""

    local: torch.Tensor
    """This rank's shard (the DTensor's own local tensor: filling it fills the DTensor)."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    global_offset: tuple[int, ...]
    """Offset of `local` in the whole tensor."""
    source: Any
    """The DTensor itself (restore hands it back in the template's place)."""
    flat_range: tuple[int, int] | None = None
    """Always None for a box piece; an empty replica piece says `(0, 0)`."""


def is_dtensor(value: object) -> bool:
    """Whether `value` is a `torch.distributed.tensor.DTensor`."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:  # nothing imported DTensor: no value can be one
        return False
    return isinstance(value, module.DTensor)


def dtensor_piece(value: Any, key: str, *, for_write: bool) -> DTensorPiece:
    """This rank's box piece of a DTensor.

    Args:
        value: the DTensor.
        key: the leaf's path, for messages.
        for_write: True when saving: a replica away from coordinate 0 of a replicated mesh
            dimension gets an empty piece ([Note: replicas write once]); False for a restore
            template, where every replica needs its data.

    Returns:
        The piece (its `local` is the DTensor's local tensor, not a copy).

    Raises:
        ValueError: an unsupported placement (`Partial`, strided sharding) or a local tensor
            whose shape is not the one its placements give.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = value.device_mesh
    placements = tuple(value.placements)
    for placement in placements:
        if type(placement) is not Shard and not isinstance(placement, Replicate):
            raise ValueError(
                f"state leaf {key!r}: DTensor placement {type(placement).__name__} "
                f"({placement}) cannot be saved; only "
                "Shard(dim) and Replicate() are (call .redistribute() to a Shard/Replicate "
                "layout, or .full_tensor(), first)"
            )
    global_shape = tuple(int(d) for d in value.shape)
    with torch.no_grad():
        local = value.to_local()
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is outside the mesh: it holds nothing
        return DTensorPiece(
            local.new_empty((0,)), global_shape, (0,) * len(global_shape), value, (0, 0)
        )
    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(
            f"state leaf {key!r}: DTensor local shard has shape {tuple(local.shape)}, its "
            f"placements {placements} give {tuple(local_shape)}"
        )
    if for_write and any(
        isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coordinate, strict=True)
    ):
        return DTensorPiece(
            local.new_empty((0,)), global_shape, (0,) * len(global_shape), value, (0, 0)
        )
    return DTensorPiece(local, global_shape, tuple(int(o) for o in offset), value)


def wrap_dtensors(template: Any, path: str = "") -> Any:
    """A copy of a restore template's containers with each DTensor leaf as its piece.

    The pieces share the DTensors' local tensors, so filling them fills the DTensors;
    `unwrap_dtensors` puts the DTensors back into the restored structure.

    Raises:
        ValueError: a DTensor with an unsupported placement (see `dtensor_piece`).
    """
    if is_dtensor(template):
        return dtensor_piece(template, path or "<root>", for_write=False)
    if isinstance(template, RankLocal):
        return RankLocal(wrap_dtensors(template.value, path))
    if isinstance(template, dict):
        return {k: wrap_dtensors(v, f"{path}/{k}") for k, v in template.items()}
    if isinstance(template, list | tuple) and not hasattr(template, "_fields"):
        items = [wrap_dtensors(v, f"{path}/{i}") for i, v in enumerate(template)]
        return tuple(items) if isinstance(template, tuple) else items
    return template


def unwrap_dtensors(state: Any) -> Any:
    """The restored structure with every `DTensorPiece` replaced by its DTensor."""
    if isinstance(state, DTensorPiece):
        return state.source
    if isinstance(state, dict):
        return {k: unwrap_dtensors(v) for k, v in state.items()}
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        items = [unwrap_dtensors(v) for v in state]
        return tuple(items) if isinstance(state, tuple) else items
    return state
