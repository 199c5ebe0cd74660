"""Assemble a target region of a tensor from stored pieces (resharding at any world size).

Pieces and targets come in two forms: a box (`global_offset` + shape) or a flat range of the
row-major flattened whole. Flat-from-flat and box-from-box intersect directly and read only the
bytes they need; mixed forms go through global flat indices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ckpt_manager._format.pieces import Piece
from ckpt_manager.errors import CorruptCheckpointError

__all__ = ["Region", "fill_region"]

# read(piece, start_element, end_element) -> 1-D tensor of those elements of the piece.
ReadFn = Callable[[Piece, int, int], torch.Tensor]
# read_into(piece, start_element, out): elements [start, start + out.numel()) into `out`.
ReadIntoFn = Callable[[Piece, int, torch.Tensor], None]


class Region:
    """The part of a whole tensor a target holds."""

    def __init__(
        self,
        global_shape: Sequence[int],
        *,
        offset: Sequence[int] | None = None,
        shape: Sequence[int] | None = None,
        flat_range: tuple[int, int] | None = None,
    ) -> None:
        """Either `flat_range`, or `offset` + `shape` (box)."""
        self.global_shape = tuple(int(d) for d in global_shape)
        self.flat_range = flat_range
        self.offset = tuple(int(o) for o in offset) if offset is not None else None
        self.shape = tuple(int(d) for d in shape) if shape is not None else None

    @classmethod
    def of_piece(cls, piece: Piece, global_shape: Sequence[int]) -> Region:
        """The region a stored piece holds (a piece without metadata is the whole tensor)."""
        if piece.flat_range is not None:
            return cls(global_shape, flat_range=piece.flat_range)
        offset = piece.global_offset if piece.global_offset is not None else (0,) * len(piece.shape)
        return cls(global_shape, offset=offset, shape=piece.shape)

    @property
    def numel(self) -> int:
        """Elements in the region."""
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        assert self.shape is not None
        return math.prod(self.shape)

    def key(self) -> tuple[object, ...]:
        """Identity of the region (replicated shards saved twice compare equal)."""
        return (self.flat_range, self.offset, self.shape)

    def flat_indices(self) -> torch.Tensor:
        """Global row-major indices of the region's elements, in the region's order."""
        if self.flat_range is not None:
            return torch.arange(self.flat_range[0], self.flat_range[1], dtype=torch.int64)
        assert self.offset is not None
        assert self.shape is not None
        strides = [math.prod(self.global_shape[d + 1 :]) for d in range(len(self.global_shape))]
        idx = torch.zeros((), dtype=torch.int64)
        for d, (o, n) in enumerate(zip(self.offset, self.shape, strict=True)):
            axis = torch.arange(o, o + n, dtype=torch.int64) * strides[d]
            idx = idx.unsqueeze(-1) + axis
        return idx.reshape(-1)

    def positions_of(self, flat_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For global indices: a mask of those inside this region and their positions in it."""
        if self.flat_range is not None:
            start, end = self.flat_range
            mask = (flat_idx >= start) & (flat_idx < end)
            return mask, flat_idx[mask] - start
        assert self.offset is not None
        assert self.shape is not None
        mask = torch.ones_like(flat_idx, dtype=torch.bool)
        pos = torch.zeros_like(flat_idx)
        rem = flat_idx
        local_strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        for d in reversed(range(len(self.global_shape))):
            coord = rem % self.global_shape[d]
            rem = rem // self.global_shape[d]
            rel = coord - self.offset[d]
            mask &= (rel >= 0) & (rel < self.shape[d])
            pos += rel * local_strides[d]
        return mask, pos[mask]


def _box_overlap(a: Region, b: Region) -> list[tuple[int, int]] | None:
    assert a.offset is not None
    assert a.shape is not None
    assert b.offset is not None
    assert b.shape is not None
    out = []
    for ao, an, bo, bn in zip(a.offset, a.shape, b.offset, b.shape, strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


def fill_region(
    target: torch.Tensor,
    region: Region,
    pieces: Sequence[Piece],
    read: ReadFn,
    what: str,
    *,
    read_into: ReadIntoFn | None = None,
) -> None:
    """Copy every stored element of `region` into `target` (shaped like the region).

    With `read_into` (`target` then has the pieces' dtype), a run of a flat piece that lands
    in one run of a flat target is read straight into it.

    Raises:
        CorruptCheckpointError: the pieces do not cover the region.
    """
    covered = 0
    seen: set[tuple[object, ...]] = set()
    flat_target: torch.Tensor | None = None
    target_idx: torch.Tensor | None = None
    for piece in pieces:
        src = Region.of_piece(piece, region.global_shape)
        if src.key() in seen:
            continue
        seen.add(src.key())
        if src.flat_range is not None and region.flat_range is not None:
            lo = max(src.flat_range[0], region.flat_range[0])
            hi = min(src.flat_range[1], region.flat_range[1])
            if lo < hi:
                start = region.flat_range[0]
                dst = target.view(-1)[lo - start : hi - start]
                if read_into is not None:
                    read_into(piece, lo - src.flat_range[0], dst)
                else:
                    dst.copy_(read(piece, lo - src.flat_range[0], hi - src.flat_range[0]))
                covered += hi - lo
            continue
        if src.flat_range is None and region.flat_range is None and src.offset is not None:
            overlap = _box_overlap(src, region)
            if overlap is None:
                continue
            assert region.offset is not None
            whole = read(piece, 0, src.numel).view(src.shape or ())
            src_sl = tuple(
                slice(lo - o, hi - o) for (lo, hi), o in zip(overlap, src.offset, strict=True)
            )
            dst_sl = tuple(
                slice(lo - o, hi - o) for (lo, hi), o in zip(overlap, region.offset, strict=True)
            )
            target[dst_sl].copy_(whole[src_sl])
            covered += math.prod(hi - lo for lo, hi in overlap)
            continue
        # Mixed forms: map through global flat indices.
        if target_idx is None:
            target_idx = region.flat_indices()
            flat_target = target.reshape(-1).clone()
        assert flat_target is not None
        mask, pos = src.positions_of(target_idx)
        hits = int(mask.sum())
        if hits:
            data = read(piece, 0, src.numel)
            flat_target[mask] = data[pos].to(flat_target.dtype)
            covered += hits
    if flat_target is not None:
        target.copy_(flat_target.view(target.shape))
    if covered != region.numel:
        raise CorruptCheckpointError(
            f"tensor {what!r}: stored pieces cover {covered} of {region.numel} elements"
        )
