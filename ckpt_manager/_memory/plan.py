"""What a memory snapshot's payload holds, and where: the rank's whole local state.

    payload = the durable shard file's bytes (what the writer writes, unchanged format)
              | zero or more alignment bytes
              | the extension: every local leaf the durable file leaves out on this rank

The durable file dedups: replicated tensors are written by rank 0 only, and a replica's
piece (HSDP, a DTensor `Replicate()` coordinate other than 0) is empty. A restore from memory
reads nothing but the rank's own slot, so the extension holds those leaves as this rank has
them (a DTensor replica's actual local shard). Each leaf starts on a 64-byte boundary.

`MemoryPlanCache` keeps the last plan while the leaves' signature is unchanged, like the
shard file's `PlanCache` ([Note: the plan cache] in `_save/plan.py`); it runs on the staging
thread, never on the training thread.

A plan carries two layout fingerprints (SHA-256 of canonical JSON):
- `layout`: this rank's leaves (keys, kinds, dtypes, local shapes, placements). A restore
  template must give the same, or memory is not used (another layout: the durable tier
  reshards).
- `global_layout`: keys, kinds, dtypes and global shapes of the shared leaves, the same on
  every rank of one state; the agreement compares it across ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ckpt_manager._format.layout import PIECE_ALIGN_BYTES
from ckpt_manager._format.shard_file import FileLayout, TensorSlot, dtype_name
from ckpt_manager._format.tree import Flattened, LeafKind, TensorLeaf, placement_key

__all__ = [
    "MemoryPlan",
    "MemoryPlanCache",
    "TensorRecord",
    "held_leaves",
    "layout_fingerprints",
]


class TensorRecord(NamedTuple):
    """One local leaf of a snapshot: what it is and where its bytes lie in the payload."""

    kind: str
    """`LeafKind` value."""
    dtype: str
    """Element type name (`shard_file.dtype_name`)."""
    shape: tuple[int, ...]
    """Shape of the local tensor (the piece of a sharded leaf)."""
    global_shape: tuple[int, ...]
    """Whole-tensor shape."""
    global_offset: tuple[int, ...] | None
    """Box offset of a sharded piece, or None."""
    flat_range: tuple[int, int] | None
    """Flat range of a sharded piece, or None."""
    offset: int
    """Byte offset in the payload."""
    nbytes: int
    """Byte length."""

    def is_whole(self) -> bool:
        """Whether the local tensor is the whole tensor (restorable without a template)."""
        if self.kind != LeafKind.SHARDED:
            return True
        numel = math.prod(self.global_shape)
        if self.flat_range is not None:
            return self.flat_range == (0, numel) or numel == 0
        return tuple(self.shape) == tuple(self.global_shape)


class MemoryPlan(NamedTuple):
    """Where every local leaf of a snapshot lies in its payload."""

    payload: FileLayout
    """The whole payload: the durable file's header and slots, then the extension's slots
    (no header of their own); `total_bytes` is the payload's size."""
    durable_bytes: int
    """Size of the durable file at the payload's start."""
    extension: tuple[int, ...]
    """Indices into `held_leaves(flat)` of the leaves in the extension, in payload order."""
    records: dict[str, TensorRecord]
    """Every local leaf by key, in flatten order."""
    layout: str
    """Fingerprint of this rank's leaves (see the module docstring)."""
    global_layout: str
    """Fingerprint of the state's shared leaves (see the module docstring)."""


def held_leaves(flat: Flattened) -> list[TensorLeaf]:
    """The leaves as this rank holds them: a DTensor replica's actual local shard in place
    of its empty write piece."""
    replicas = flat.replica_leaves
    if not replicas:
        return list(flat.leaves)
    return [replicas.get(leaf.key, leaf) for leaf in flat.leaves]


def _signature(leaf: TensorLeaf) -> tuple[Any, ...]:
    return (
        leaf.key,
        str(leaf.kind),
        dtype_name(leaf.tensor.dtype),
        tuple(leaf.tensor.shape),
        tuple(leaf.global_shape),
        leaf.global_offset,
        leaf.flat_range,
    )


def layout_fingerprints(leaves: Sequence[TensorLeaf]) -> tuple[str, str]:
    """`(layout, global_layout)` of leaves as this rank holds them (see the module docstring)."""
    local = [list(map(_jsonable, _signature(leaf))) for leaf in leaves]
    shared = [
        [leaf.key, str(leaf.kind), dtype_name(leaf.tensor.dtype), list(leaf.global_shape)]
        for leaf in leaves
        if leaf.kind is not LeafKind.RANK_LOCAL
    ]
    return _digest(local), _digest(shared)


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()


def _align(n: int) -> int:
    return (n + PIECE_ALIGN_BYTES - 1) // PIECE_ALIGN_BYTES * PIECE_ALIGN_BYTES


def plan_memory(
    leaves: Sequence[TensorLeaf], durable: Sequence[TensorLeaf], durable_layout: FileLayout
) -> MemoryPlan:
    """Plan a payload.

    Args:
        leaves: every local leaf (`held_leaves`), in flatten order.
        durable: the leaves the durable file holds (`plan.leaves_to_write`), in file order.
        durable_layout: the durable file's layout.
    """
    in_file = {leaf.key: slot for leaf, slot in zip(durable, durable_layout.slots, strict=True)}
    cursor = durable_layout.total_bytes
    extension: list[int] = []
    ext_slots: list[TensorSlot] = []
    records: dict[str, TensorRecord] = {}
    for index, leaf in enumerate(leaves):
        slot = in_file.get(leaf.key)
        if slot is None:
            dtype, shape = leaf.tensor.dtype, tuple(leaf.tensor.shape)
            nbytes = math.prod(shape) * dtype.itemsize
            cursor = _align(cursor)
            slot = TensorSlot(leaf.key, dtype, shape, cursor, nbytes)
            cursor += nbytes
            extension.append(index)
            ext_slots.append(slot)
        records[leaf.key] = TensorRecord(
            str(leaf.kind),
            dtype_name(leaf.tensor.dtype),
            tuple(leaf.tensor.shape),
            tuple(leaf.global_shape),
            leaf.global_offset,
            leaf.flat_range,
            slot.offset,
            slot.nbytes,
        )
    payload = FileLayout(durable_layout.header, durable_layout.slots + tuple(ext_slots), cursor)
    layout, global_layout = layout_fingerprints(leaves)
    return MemoryPlan(
        payload, durable_layout.total_bytes, tuple(extension), records, layout, global_layout
    )


class MemoryPlanCache:
    """The last snapshot's plan, kept while the leaves' signature is unchanged."""

    def __init__(self) -> None:
        """Start empty: the first snapshot plans."""
        self._key: tuple[Any, ...] | None = None
        self._plan: MemoryPlan | None = None
        self.num_planned = 0
        """How many times a plan was computed (not reused)."""

    def plan(
        self, flat: Flattened, durable: Sequence[TensorLeaf], durable_layout: FileLayout
    ) -> tuple[MemoryPlan, list[torch.Tensor]]:
        """The plan of `flat`'s snapshot and the extension's tensors, in payload order."""
        leaves = held_leaves(flat)
        # The raw fields, not `_signature`'s conversions for the fingerprints (0.3 ms of the
        # staging thread per snapshot of 209 leaves).
        key = (durable_layout, tuple(map(placement_key, leaves)))
        if self._plan is None or key != self._key:
            self._plan = plan_memory(leaves, durable, durable_layout)
            self._key = key
            self.num_planned += 1
        return self._plan, [leaves[i].tensor for i in self._plan.extension]
