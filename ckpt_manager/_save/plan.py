"""What a rank writes at a save, and its shard file's plan (layout and piece records).

`leaves_to_write` picks the tensors of the flattened state this rank stores; `piece_records`
describes each as a piece of the rank's shard file (the input of its index object);
`PlanCache` keeps the last plan while the state keeps its shape.

A training run saves the same tree of tensors every time: same keys, dtypes, shapes and
placements, new values. Planning the file (`shard_file.plan_layout`: offsets and the JSON
header) and describing its pieces (`piece_records`) depend on exactly that, not on the
values, so `PlanCache` keeps the last plan and hands it back while the leaves' signature is
unchanged. Any change (a key, a dtype, a shape, a placement, the file name) plans afresh.

[Note: the plan cache] On the bench's 156-leaf GPT + AdamW state, planning cost 0.8 ms of the
training thread's ~2 ms per `save()` (quiet; 1.6 of 4.6 ms with two ranks on two cores), and
`save()` is most of the stall: the snapshot copy overlaps forward/backward. Building the
signature costs a tuple per leaf (about a tenth of that). The cached objects are immutable
(NamedTuples of tuples, `bytes`), so sharing them between saves in flight is safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ckpt_manager._format.pieces import Piece
from ckpt_manager._format.rank_index import PieceRecord
from ckpt_manager._format.shard_file import FileLayout, dtype_name, plan_layout
from ckpt_manager._format.tree import Flattened, LeafKind, TensorLeaf, placement_key

__all__ = ["PlanCache", "leaves_to_write", "piece_records"]


def leaves_to_write(flat: Flattened, rank: int) -> list[TensorLeaf]:
    """The leaves this rank writes: rank-local always, replicated on rank 0, sharded unless
    the rank's piece is empty.

    An empty piece of a non-empty tensor holds nothing to read back (format 2 lists only
    non-empty pieces), so a rank whose pieces are all empty — a replica of a hybrid (HSDP)
    layout, a DTensor replica — writes no shard file at all, and a hybrid checkpoint takes
    the bytes of one replica's. A zero-element tensor keeps its (empty) pieces so the top
    manifest still names it.
    """
    return [
        leaf
        for leaf in flat.leaves
        if (leaf.kind is not LeafKind.REPLICATED or rank == 0)
        and not (
            leaf.kind is LeafKind.SHARDED
            and leaf.tensor.numel() == 0
            and math.prod(leaf.global_shape) > 0
        )
    ]


def piece_records(
    leaves: Sequence[TensorLeaf], layout: FileLayout, file_name: str | None
) -> list[PieceRecord]:
    """One record per leaf this rank writes: its piece in the rank's shard file."""
    records = []
    for leaf, slot in zip(leaves, layout.slots, strict=True):
        assert file_name is not None
        piece = Piece(
            file_name, slot.offset, slot.nbytes, slot.shape, leaf.global_offset, leaf.flat_range
        )
        records.append(
            PieceRecord(
                leaf.key,
                str(leaf.kind),
                dtype_name(leaf.tensor.dtype),
                tuple(leaf.global_shape),
                piece,
            )
        )
    return records


class PlanCache:
    """The last save's shard-file plan, keyed by what it depends on (one per manager)."""

    def __init__(self) -> None:
        """Start empty: the first save plans."""
        self._signature: tuple[Any, ...] | None = None
        self._plan: tuple[FileLayout, tuple[PieceRecord, ...]] | None = None
        self.num_planned = 0
        """How many times a plan was computed (not reused)."""

    def plan(
        self, leaves: Sequence[TensorLeaf], file_name: str | None
    ) -> tuple[FileLayout, tuple[PieceRecord, ...]]:
        """The layout of this rank's shard file and its piece records, for `leaves` in order.

        Args:
            leaves: the tensors this rank writes (`leaves_to_write`).
            file_name: the shard file's name (None: the rank writes none).

        Returns:
            `(layout, records)`, the same objects as last time when nothing they depend on
            changed.
        """
        signature = (file_name, tuple(map(placement_key, leaves)))
        if self._plan is not None and signature == self._signature:
            return self._plan
        layout = plan_layout([(x.key, x.tensor.dtype, tuple(x.tensor.shape)) for x in leaves])
        self._plan = (layout, tuple(piece_records(leaves, layout, file_name)))
        self._signature = signature
        self.num_planned += 1
        return self._plan
