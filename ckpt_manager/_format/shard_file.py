"""The shard file format: raw tensor bytes behind a JSON header, never pickle.

One file per rank and step (`rank-<r:05d>.bin`)::

    b"TDCKPT01" | u64 little-endian header length | header JSON | zero padding | tensor bytes

The header lists every tensor (`dtype`, `shape`, absolute byte `offset`, `nbytes`); each
tensor starts on a 64-byte boundary. The manifest repeats the same offsets (it is the source of
truth); the header keeps a lone file self-describing. The layout is computed in the trainer and
the header is written into the staging buffer with the tensors, so the writer ships one
contiguous byte range.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ckpt_manager._format.dtypes import ITEM_SIZES
from ckpt_manager._format.layout import PIECE_ALIGN_BYTES

__all__ = [
    "MAGIC",
    "FileLayout",
    "TensorSlot",
    "dtype_from_name",
    "dtype_name",
    "plan_layout",
    "read_header",
]

MAGIC = b"TDCKPT01"
_ALIGN = PIECE_ALIGN_BYTES  # manifest validation rejects a piece at any other offset
_PREFIX = struct.Struct("<8sQ")

# Names come from `dtypes.ITEM_SIZES` (what a manifest may name); a test pins that table to
# torch's own dtypes.
_DTYPES: dict[str, torch.dtype] = {
    name: value
    for name in ITEM_SIZES
    if isinstance(value := getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; raises ValueError for anything that is not a torch dtype."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class TensorSlot(NamedTuple):
    """Where one tensor lives in a shard file."""

    key: str
    """Tensor key (its path in the state)."""
    dtype: torch.dtype
    """Element type."""
    shape: tuple[int, ...]
    """Shape of the stored piece."""
    offset: int
    """Absolute byte offset in the file."""
    nbytes: int
    """Byte length."""


class FileLayout(NamedTuple):
    """A planned shard file: header bytes and tensor slots."""

    header: bytes
    """Magic, length and JSON header, padded to the first tensor."""
    slots: tuple[TensorSlot, ...]
    """One slot per tensor, in file order."""
    total_bytes: int
    """Size of the whole file."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_layout(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> FileLayout:
    """Place tensors in a file.

    Args:
        tensors: `(key, dtype, shape)` per tensor, in file order.

    Returns:
        The layout; `header` already holds the final offsets.
    """
    relative: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    cursor = 0
    for key, dtype, shape in tensors:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        relative.append((key, dtype, tuple(shape), cursor, nbytes))
        cursor = _align(cursor + nbytes)
    # Offsets in the header are absolute; the header length depends on them, so grow the
    # reserved space until the JSON fits (two rounds at most in practice).
    reserved = _align(_PREFIX.size + 256)
    while True:
        entries = {
            key: {
                "dtype": dtype_name(dtype),
                "shape": list(shape),
                "offset": reserved + rel,
                "nbytes": nbytes,
            }
            for key, dtype, shape, rel, nbytes in relative
        }
        body = json.dumps({"format_version": 1, "tensors": entries}, sort_keys=True).encode()
        needed = _align(_PREFIX.size + len(body))
        if needed <= reserved:
            break
        reserved = needed
    header = _PREFIX.pack(MAGIC, len(body)) + body
    header += b"\x00" * (reserved - len(header))
    slots = tuple(
        TensorSlot(key, dtype, shape, reserved + rel, nbytes)
        for key, dtype, shape, rel, nbytes in relative
    )
    total = reserved + (relative[-1][3] + relative[-1][4] if relative else 0)
    return FileLayout(header, slots, total)


def read_header(data: bytes) -> dict[str, object]:
    """Parse the JSON header at the start of a shard file (at least its first bytes).

    Raises:
        ValueError: not a shard file, or the header is cut off or not JSON.
    """
    if len(data) < _PREFIX.size:
        raise ValueError("file too short for a shard header")
    magic, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}: not a trainingd shard file")
    body = data[_PREFIX.size : _PREFIX.size + length]
    if len(body) != length:
        raise ValueError("shard header is cut off")
    parsed = json.loads(body)
    if not isinstance(parsed, dict):
        raise ValueError("shard header is not a JSON object")
    return parsed
