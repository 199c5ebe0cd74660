"""Format version 1 manifests (written before issue #18): read, never written.

A format-1 manifest holds every piece of every rank inline, so it parses straight into a
complete `Manifest` (`pieces` per tensor, `rank_local` per saved rank); the header fields it
shares with format 2 (step, world size, run id, times, versions, metrics, files, tree, the
checksum) are `_format/manifest.py`'s, which calls `parse_pieces` for the rest::

    {"format": "trainingd-checkpoint", "format_version": 1, "step": N, "world_size": W,
     "run_id": str, "created_unix_s": float, "committed_unix_s": float,
     "versions": {"trainingd": str, "torch": str, "python": str}, "metrics": {...},
     "files": {name: file record},
     "tree": skeleton (see `_format/tree.py`),
     "tensors": {key: {"dtype": str, "global_shape": [...], "kind": "replicated"|"sharded",
                       "pieces": [piece, ...]}},
     "rank_local": [{"trees": [skeleton, ...], "tensors": {key: {"dtype": str, "piece": piece}}}]}
    ... and last (manifests written since issue 13), "manifest_crc32": int

File records and pieces are `_format/pieces.py`'s, with its checks: every piece inside its
file and its tensor, no two pieces of a file overlapping, no global shape larger than the
step's files. `rank_local` may be shorter than the world size: ranks past its end saved no
RankLocal state (`ckptctl reshard` to more ranks wrote such steps), and keep their
template's values on restore. The committed fixture `tests/ckpt_manager/fixtures/
v1_checkpoint/` keeps this reader honest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_manager._format.dtypes import item_size
from ckpt_manager._format.pieces import (
    Extent,
    FileEntry,
    check_no_overlap,
    check_place,
    parse_piece,
    parse_tensor_head,
)

__all__ = ["FORMAT_VERSION_PIECES", "parse_pieces"]

FORMAT_VERSION_PIECES = 1
"""Every piece in the manifest itself."""


def parse_pieces(
    doc: Mapping[str, Any], files: Mapping[str, FileEntry]
) -> tuple[dict[str, dict[str, Any]], tuple[dict[str, Any], ...]]:
    """The tensor records and per-rank RankLocal state of a format-1 manifest, checked.

    Args:
        doc: the manifest document.
        files: its parsed `files` (names already checked).

    Returns:
        `(tensors, rank_local)` in the complete form of `Manifest`.

    Raises:
        ValueError, TypeError, KeyError, IndexError: a record is malformed or a piece does
            not fit (the caller reports the manifest as corrupt).
    """
    stored_bytes = sum(f.size for f in files.values())
    extents: list[Extent] = []
    tensors: dict[str, dict[str, Any]] = {}
    for key, rec in dict(doc["tensors"]).items():
        what = f"tensor {key!r}"
        dtype, global_shape = parse_tensor_head(key, rec, stored_bytes)
        itemsize = item_size(dtype)
        pieces = []
        for i, p in enumerate(rec["pieces"]):
            piece = parse_piece(p, files, itemsize, what)
            if piece.nbytes:  # empty pieces may claim any place
                check_place(piece, global_shape, what)
                extents.append((piece.file, piece.offset, piece.offset + piece.nbytes, key, i))
            pieces.append(piece)
        tensors[key] = {
            "dtype": dtype,
            "global_shape": list(global_shape),
            "kind": rec["kind"],
            "pieces": pieces,
        }
    rank_local = []
    for rank, rl in enumerate(list(doc["rank_local"])):
        rl_tensors = {}
        for key, rec in dict(rl["tensors"]).items():
            what = f"rank-local tensor {key!r} of rank {rank}"
            piece = parse_piece(rec["piece"], files, item_size(rec["dtype"]), what)
            if piece.nbytes:
                end = piece.offset + piece.nbytes
                extents.append((piece.file, piece.offset, end, key, -1 - rank))
            rl_tensors[key] = {"dtype": rec["dtype"], "piece": piece}
        rank_local.append({"trees": list(rl["trees"]), "tensors": rl_tensors})
    check_no_overlap(extents)
    return tensors, tuple(rank_local)
