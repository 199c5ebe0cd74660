"""A step's file records and the tensor pieces in them, with the checks every reader relies on.

Shared by the top manifest (`_format/manifest.py`), the rank index objects
(`_format/rank_index.py`) and the format-1 reader (`_format/legacy_v1.py`)::

    file record = {"size": int, "crc32": int [, "checksum_algorithm": "crc32c"]}
    piece       = {"file": name, "offset": int, "nbytes": int, "shape": [...],
                   "global_offset": [...] | null, "flat_range": [start, end] | null}

A file record's `crc32` holds its checksum by `checksum_algorithm` (`_format/checksum.py`);
records without that field (every manifest before it existed) are CRC-32, and the field is
only written for other algorithms, so CRC-32 records serialise as they always did.

Parsing validates everything a reader will touch, so a record that parses never makes a
reader fetch bytes outside a piece or allocate more than the step's files hold:

- every piece's extent: `nbytes` is what its dtype and shape hold, `offset` is 64-byte aligned
  (`shard_file.plan_layout` places every tensor so), `[offset, offset + nbytes)` lies inside
  the file's recorded size and overlaps no other piece of that file (`check_no_overlap`);
- every piece's place in its tensor (`check_place`): a flat range holds as many elements as
  the piece's shape and lies inside the global shape, a box has the global shape's rank and
  lies inside it, a piece with neither is the whole tensor (empty pieces may claim any place,
  see [Note: empty pieces anywhere] in `_format/tree.py`);
- every global shape holds at most as many bytes as the step's files together
  (`check_global_shape`), so consolidating a tensor never allocates more than is stored (the
  file sizes themselves are checked against storage by `steps.verify_files` before anything
  is read).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

from ckpt_manager._format.checksum import ChecksumAlgorithm
from ckpt_manager._format.dtypes import item_size
from ckpt_manager._format.layout import PIECE_ALIGN_BYTES

__all__ = [
    "Extent",
    "FileEntry",
    "Piece",
    "as_count",
    "as_shape",
    "check_global_shape",
    "check_no_overlap",
    "check_place",
    "is_count",
    "parse_piece",
    "parse_tensor_head",
]


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file of a step as the manifest records it."""

    size: int
    """Bytes."""
    crc32: int
    """Checksum of the whole file by `algorithm` (the JSON key predates other algorithms)."""
    algorithm: ChecksumAlgorithm = ChecksumAlgorithm.CRC32
    """How `crc32` was computed; CRC-32 for records that name no algorithm."""

    def to_json(self) -> dict[str, Any]:
        """The record as the manifest stores it (no algorithm field for CRC-32)."""
        out: dict[str, Any] = {"size": self.size, "crc32": self.crc32}
        if self.algorithm is not ChecksumAlgorithm.CRC32:
            out["checksum_algorithm"] = self.algorithm.value
        return out


@dataclasses.dataclass(frozen=True)
class Piece:
    """A stored tensor piece: where it is and which part of the whole it holds."""

    file: str
    """Shard file name, relative to the step folder."""
    offset: int
    """Byte offset in the file."""
    nbytes: int
    """Byte length."""
    shape: tuple[int, ...]
    """Shape of the stored piece."""
    global_offset: tuple[int, ...] | None = None
    """Box offset in the whole tensor (box form)."""
    flat_range: tuple[int, int] | None = None
    """Range of the flattened whole (flat form)."""

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "global_offset": None if self.global_offset is None else list(self.global_offset),
            "flat_range": None if self.flat_range is None else list(self.flat_range),
        }


def is_count(value: Any) -> bool:
    """Whether a JSON value is an integer >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def as_count(value: Any, what: str, minimum: int = 0) -> int:
    """A JSON value that must be an integer >= `minimum`.

    Raises:
        ValueError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def as_shape(value: Any, what: str) -> tuple[int, ...]:
    """A JSON list of sizes.

    Raises:
        ValueError: not a list of integers >= 0.
    """
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list")
    return tuple(as_count(v, what) for v in value)


def parse_piece(doc: Any, files: Mapping[str, FileEntry], itemsize: int, what: str) -> Piece:
    """Parse one piece record and check its extent in its file (see the module docstring).

    Raises:
        ValueError: the piece is malformed, names an unlisted file or lies outside it.
    """
    # Runs once per tensor per rank (16k times for `ckptctl list` of 300 steps): checks are
    # inlined and messages built only on failure. A name listed in `files` was validated
    # when `files` was parsed. Overlaps between pieces are `check_no_overlap`'s.
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: piece must be an object")
    name = doc["file"]
    entry = files.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"{what}: file {name!r} is not listed in files")
    offset, nbytes = doc["offset"], doc["nbytes"]
    if not (is_count(offset) and is_count(nbytes)):
        raise ValueError(f"{what}: offset {offset!r} and nbytes {nbytes!r} must be integers >= 0")
    shape = as_shape(doc["shape"], what)
    numel = math.prod(shape)
    if numel * itemsize != nbytes:
        raise ValueError(
            f"{what}: {nbytes} bytes do not hold shape {shape} ({itemsize}-byte items)"
        )
    if offset % PIECE_ALIGN_BYTES:
        raise ValueError(f"{what}: offset {offset} is not {PIECE_ALIGN_BYTES}-byte aligned")
    if offset + nbytes > entry.size:
        raise ValueError(f"{what}: bytes [{offset}, {offset + nbytes}) exceed file {name!r}")
    box = doc.get("global_offset")
    flat = doc.get("flat_range")
    if flat is not None:
        if not (
            isinstance(flat, list)
            and len(flat) == 2
            and is_count(flat[0])
            and is_count(flat[1])
            and flat[0] <= flat[1]
        ):
            raise ValueError(f"{what}: flat_range {flat!r} must be [start, end], start <= end")
        if flat[1] - flat[0] != numel:
            raise ValueError(
                f"{what}: flat_range {flat} holds {flat[1] - flat[0]} elements, shape {shape} "
                f"holds {numel}"
            )
    return Piece(
        name,
        offset,
        nbytes,
        shape,
        None if box is None else as_shape(box, what),
        None if flat is None else (flat[0], flat[1]),
    )


def check_place(piece: Piece, global_shape: tuple[int, ...], what: str) -> None:
    """A non-empty piece lies inside its tensor: its flat range inside the flattened whole,
    its box inside the global shape, or, with neither, it is the whole.

    Raises:
        ValueError: it does not.
    """
    flat = piece.flat_range
    if flat is not None:
        numel = math.prod(global_shape)
        if flat[1] > numel:
            raise ValueError(
                f"{what}: flat_range {list(flat)} lies outside the {numel} elements of "
                f"global shape {global_shape}"
            )
        return
    if piece.global_offset is None:
        if piece.shape != global_shape:
            raise ValueError(
                f"{what}: shape {piece.shape} is not the whole of global shape {global_shape}, "
                "and the piece names no place in it"
            )
        return
    box = piece.global_offset
    if len(box) != len(global_shape) or len(piece.shape) != len(global_shape):
        raise ValueError(
            f"{what}: box at {box} of shape {piece.shape} does not have the rank of global "
            f"shape {global_shape}"
        )
    for o, n, g in zip(box, piece.shape, global_shape, strict=True):
        if o + n > g:
            raise ValueError(
                f"{what}: box at {box} of shape {piece.shape} exceeds global shape {global_shape}"
            )


Extent = tuple[str, int, int, str, int]
"""(file, first byte, end byte, tensor key, piece index or -1 - rank for a rank-local tensor)"""


def _describe(extent: Extent) -> str:
    key, index = extent[3], extent[4]
    if index >= 0:
        return f"tensor {key!r} piece {index}"
    return f"rank-local tensor {key!r} of rank {-1 - index}"


def check_no_overlap(extents: list[Extent]) -> None:
    """No two non-empty pieces share a byte of the same file.

    Args:
        extents: an `Extent` per non-empty piece (sorted in place).

    Raises:
        ValueError: two extents overlap.
    """
    extents.sort()
    for a, b in itertools.pairwise(extents):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(f"{_describe(a)} and {_describe(b)} overlap in file {a[0]!r}")


def parse_tensor_head(
    key: str, rec: Mapping[str, Any], stored_bytes: int
) -> tuple[str, tuple[int, ...]]:
    """A tensor record's dtype and global shape, checked before any piece of it: a known
    kind, and a global shape whose bytes fit in the step's files (restore allocates the
    whole tensor to consolidate it).

    Raises:
        ValueError, KeyError: the record is malformed, or the shape is larger than the files.
    """
    what = f"tensor {key!r}"
    dtype = str(rec["dtype"])
    if rec["kind"] not in ("replicated", "sharded"):
        raise ValueError(f"{what}: unknown kind {rec['kind']!r}")
    shape = as_shape(rec["global_shape"], f"{what} global_shape")
    check_global_shape(what, dtype, shape, stored_bytes)
    return dtype, shape


def check_global_shape(what: str, dtype: str, shape: tuple[int, ...], stored_bytes: int) -> int:
    """Elements of a tensor; its bytes must fit in the step's files (restore allocates it).

    Raises:
        ValueError: the whole tensor would hold more bytes than the step's files.
    """
    numel = math.prod(shape)
    if numel * item_size(dtype) > stored_bytes:
        raise ValueError(
            f"{what}: global shape {shape} needs {numel * item_size(dtype)} bytes, more "
            f"than the {stored_bytes} bytes of the step's files"
        )
    return numel
