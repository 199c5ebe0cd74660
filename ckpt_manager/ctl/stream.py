"""Stream a stored tensor as bounded chunks of its row-major bytes (restore / export).

[Note: bounded memory] A consolidated or resharded tensor is produced chunk by chunk: each
chunk is a flat range of the whole, assembled by `reshard.fill_region` from only the stored
bytes it needs (ranged reads of the shard files). At most `prefetch + 1` chunks of
`chunk_bytes` are alive at once, so memory does not grow with the checkpoint. Stored pieces
that are contiguous in the flattened whole (flat ranges, whole tensors, row blocks) are read
range by range; a true N-D box piece cannot be and costs one whole piece in memory.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.pieces import Piece
from ckpt_manager._format.shard_file import dtype_from_name
from ckpt_manager._load.reshard import Region, fill_region
from ckpt_manager._load.restore import read_piece
from ckpt_manager._store.storage import Storage

__all__ = ["TensorSource", "as_flat_piece", "chunk_ranges", "stream_range"]


def as_flat_piece(piece: Piece, global_shape: Sequence[int]) -> Piece | None:
    """The same piece in flat-range form, or None if it is not contiguous in the whole.

    A piece is contiguous when it is flat already, or a box whose dimensions are single
    indices, then at most one partial dimension, then whole ones (whole tensors, row blocks).
    """
    if piece.flat_range is not None:
        return piece
    shape = tuple(int(d) for d in global_shape)
    offset = piece.global_offset if piece.global_offset is not None else (0,) * len(shape)
    if len(piece.shape) != len(shape):
        return None
    # The last dimension that is not whole may be partial; every dimension before it must
    # be a single index (extent 1) and every one after it whole.
    partial = [d for d in range(len(shape)) if piece.shape[d] != shape[d]]
    if partial and any(piece.shape[d] != 1 for d in range(partial[-1])):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    start = sum(o * s for o, s in zip(offset, strides, strict=True))
    numel = math.prod(piece.shape)
    return dataclasses.replace(piece, global_offset=None, flat_range=(start, start + numel))


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """A tensor of a committed step, with everything needed to read any part of it."""

    key: str
    """Tensor key in the manifest."""
    dtype: torch.dtype
    """Element type."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    pieces: tuple[Piece, ...]
    """Stored pieces (flat form where possible)."""
    contiguous: bool
    """Whether every piece is a flat range (chunked reads are exact)."""

    @classmethod
    def of(
        cls, key: str, dtype_name: str, global_shape: Sequence[int], pieces: Sequence[Piece]
    ) -> TensorSource:
        """Build from manifest fields."""
        shape = tuple(int(d) for d in global_shape)
        flat = [as_flat_piece(p, shape) for p in pieces]
        if all(p is not None for p in flat):
            return cls(key, dtype_from_name(dtype_name), shape, tuple(p for p in flat if p), True)
        return cls(key, dtype_from_name(dtype_name), shape, tuple(pieces), False)

    @classmethod
    def of_manifest(cls, m: Manifest, key: str) -> TensorSource:
        """A replicated or sharded tensor of the manifest."""
        rec = m.tensors[key]
        return cls.of(key, rec["dtype"], rec["global_shape"], rec["pieces"])

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.global_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.dtype.itemsize


def chunk_ranges(start: int, end: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split elements `[start, end)` into ranges of at most `chunk_bytes`."""
    per = max(1, chunk_bytes // max(1, itemsize))
    return [(a, min(end, a + per)) for a in range(start, end, per)]


def _reader(
    storage: Storage, manifest: Manifest, src: TensorSource
) -> Callable[[Piece, int, int], torch.Tensor]:
    def read(p: Piece, s: int, e: int) -> torch.Tensor:
        return read_piece(storage, manifest.step, p, src.dtype, s, e)

    return read


def _fill_flat(
    read: Callable[[Piece, int, int], torch.Tensor], src: TensorSource, start: int, end: int
) -> torch.Tensor:
    out = torch.empty(end - start, dtype=src.dtype)
    if end > start:
        region = Region(src.global_shape, flat_range=(start, end))
        fill_region(out, region, src.pieces, read, src.key)
    return out


def _fill_whole(read: Callable[[Piece, int, int], torch.Tensor], src: TensorSource) -> torch.Tensor:
    out = torch.empty(src.global_shape, dtype=src.dtype)
    region = Region(src.global_shape, offset=(0,) * len(src.global_shape), shape=src.global_shape)
    fill_region(out, region, src.pieces, read, src.key)
    return out.reshape(-1)


def stream_range(
    storage: Storage,
    manifest: Manifest,
    src: TensorSource,
    start: int,
    end: int,
    *,
    chunk_bytes: int,
    prefetch: int,
    pool: ThreadPoolExecutor | None,
) -> Iterator[torch.Tensor]:
    """Yield elements `[start, end)` of the flattened tensor as 1-D chunks, in order.

    Up to `prefetch` chunks are read ahead on `pool` (object stores: latency hides there).
    """
    read = _reader(storage, manifest, src)
    if not src.contiguous:
        yield _fill_whole(read, src)[start:end]
        return
    ranges = chunk_ranges(start, end, src.dtype.itemsize, chunk_bytes)
    if pool is None or prefetch < 1:
        for a, b in ranges:
            yield _fill_flat(read, src, a, b)
        return
    queue: collections.deque[Future[torch.Tensor]] = collections.deque()
    pending = iter(ranges)

    def submit() -> bool:
        nxt = next(pending, None)
        if nxt is None:
            return False
        queue.append(pool.submit(_fill_flat, read, src, nxt[0], nxt[1]))
        return True

    try:
        for _ in range(prefetch + 1):
            if not submit():
                break
        while queue:
            chunk = queue.popleft().result()
            submit()
            yield chunk
    finally:
        for f in queue:
            f.cancel()


def tensor_bytes(chunk: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor (no copy)."""
    flat = chunk.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array)


def walk_tensors(node: Any, visit: Callable[[list[Any]], None]) -> None:
    """Call `visit` on every tensor node (`["T", key]` / `["S", key]`) of a skeleton."""
    tag, body = node[0], node[1]
    if tag in ("T", "S"):
        visit(node)
    elif tag == "d":
        for _, child in body:
            walk_tensors(child, visit)
    elif tag in ("l", "t"):
        for child in body:
            walk_tensors(child, visit)
