"""Per-rank index objects (format version 2): what one rank wrote at a step, read on demand.

Each rank's writer writes `step-<N>/rank-<r:05d>.index.json` right after its shard file; the
coordinator's `manifest.json` lists every index with its size and CRC-32 (among `files`) and,
per tensor, only which ranks hold non-empty pieces of it, so a restoring rank reads the top
manifest plus the few indexes its tensors live in (see [Note: the top manifest stays small]
in `_format/manifest.py`; names in `_format/layout.py`)::

    {"format": "trainingd-rank-index", "format_version": 2, "step": N, "rank": r,
     "file": {"name": "rank-00003.bin", "size": int, "crc32": int,
              "checksum_algorithm": "crc32"} | null,
     "tensors": {key: {"dtype": str, "piece": piece}},
     "rank_local": {"trees": [skeleton, ...], "tensors": {key: {"dtype": str, "piece": piece}}}}
    piece = {"offset": int, "nbytes": int, "shape": [...], "global_offset": [...] | null,
             "flat_range": [start, end] | null}      (always in the index's own `file`)

`tensors` holds the rank's non-empty pieces of replicated and sharded tensors (dtype and
global shape are the top manifest's); `rank_local` its RankLocal subtrees, empty pieces
included (a rank-local tensor is this rank's whole tensor, so it is always needed). Every
saved rank writes an index, even one without a shard file (its RankLocal plain values).

`checksum_algorithm` names the algorithm of the shard file's checksum (stored under
`crc32`): new saves write "crc32c" (the staging copy's, `_format/checksum.py`); an index
without the field means "crc32" (zlib's).

Torch-free: the writer process builds indexes, `ckptctl` reads them. Reading and writing them
on storage is `_store/indexes.py`'s job; this module only says what their bytes mean.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_manager._format.checksum import crc32, parse_algorithm
from ckpt_manager._format.dtypes import item_size
from ckpt_manager._format.layout import index_file_name
from ckpt_manager._format.manifest import Manifest, check_tensor_place
from ckpt_manager._format.pieces import FileEntry, Piece, check_no_overlap, parse_piece
from ckpt_manager.errors import CorruptCheckpointError

__all__ = [
    "DEFAULT_CHECKSUM_ALGORITHM",
    "INDEX_FORMAT_NAME",
    "IndexedFile",
    "PieceRecord",
    "RankIndex",
    "RankReport",
    "assemble",
    "check_rank_index",
    "piece_of",
]

INDEX_FORMAT_NAME = "trainingd-rank-index"
DEFAULT_CHECKSUM_ALGORITHM = "crc32"
"""The shard checksum this code computes (zlib's CRC-32); also what a missing field means."""
_INDEX_VERSION = 2


class PieceRecord(NamedTuple):
    """One tensor piece a rank wrote, as the save path describes it (input of `RankIndex`)."""

    key: str
    """Tensor key (its path in the state)."""
    kind: str
    """"replicated", "sharded" or "rank_local"."""
    dtype: str
    """dtype name (`format.dtype_name`)."""
    global_shape: tuple[int, ...]
    """Whole-tensor shape (the piece's own shape for replicated and rank-local tensors)."""
    piece: Piece
    """Where the piece is in the rank's shard file and which part of the whole it holds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexedFile:
    """The shard file an index describes."""

    name: str
    """File name inside the step folder."""
    size: int
    """Bytes."""
    crc32: int
    """Checksum of the whole file (algorithm: `checksum_algorithm`)."""
    checksum_algorithm: str = DEFAULT_CHECKSUM_ALGORITHM
    """Which checksum `crc32` holds; "crc32" is zlib's CRC-32."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankIndex:
    """One rank's index object (see the module docstring for its JSON form)."""

    step: int
    """Training step."""
    rank: int
    """The rank that wrote it."""
    file: IndexedFile | None
    """Its shard file; None when the rank had no tensor to write."""
    tensors: Mapping[str, tuple[str, Piece]]
    """Non-empty pieces of replicated and sharded tensors: key -> (dtype, piece)."""
    rank_local_trees: Sequence[Any]
    """Skeletons of the rank's RankLocal subtrees, by index."""
    rank_local: Mapping[str, tuple[str, Piece]]
    """The rank's RankLocal tensors: key -> (dtype, piece)."""

    @classmethod
    def build(
        cls,
        *,
        step: int,
        rank: int,
        file: IndexedFile | None,
        records: Sequence[PieceRecord],
        rank_local_trees: Sequence[Any],
    ) -> RankIndex:
        """The index of one rank from its piece records (empty shared pieces are dropped).

        Raises:
            ValueError: a record names another file than `file`, or a kind it does not know.
        """
        tensors: dict[str, tuple[str, Piece]] = {}
        local: dict[str, tuple[str, Piece]] = {}
        for rec in records:
            if file is None or rec.piece.file != file.name:
                raise ValueError(
                    f"rank {rank}: piece of {rec.key!r} is in {rec.piece.file!r}, not in the "
                    f"rank's shard file {None if file is None else file.name!r}"
                )
            if rec.kind == "rank_local":
                local[rec.key] = (rec.dtype, rec.piece)
            elif rec.kind in ("replicated", "sharded"):
                if rec.piece.nbytes:
                    tensors[rec.key] = (rec.dtype, rec.piece)
            else:
                raise ValueError(f"tensor {rec.key!r}: unknown kind {rec.kind!r}")
        return cls(
            step=step,
            rank=rank,
            file=file,
            tensors=tensors,
            rank_local_trees=list(rank_local_trees),
            rank_local=local,
        )

    def to_json(self) -> bytes:
        """Serialise (compact UTF-8 JSON)."""
        doc = {
            "format": INDEX_FORMAT_NAME,
            "format_version": _INDEX_VERSION,
            "step": self.step,
            "rank": self.rank,
            "file": None if self.file is None else dataclasses.asdict(self.file),
            "tensors": {k: _entry_json(d, p) for k, (d, p) in self.tensors.items()},
            "rank_local": {
                "trees": list(self.rank_local_trees),
                "tensors": {k: _entry_json(d, p) for k, (d, p) in self.rank_local.items()},
            },
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray, *, step: int, rank: int) -> RankIndex:
        """Parse and validate an index on its own (pieces inside its file, no overlaps).

        The tensors' dtypes and places are checked against the top manifest by
        `complete_manifest` / the loader, which know the global shapes.

        Raises:
            CorruptCheckpointError: not an index of this step and rank, or any field invalid.
        """
        try:
            return _parse(json.loads(data), step, rank)
        except (ValueError, TypeError, KeyError, IndexError) as err:
            raise CorruptCheckpointError(
                f"invalid index of rank {rank} at step {step}: {err}"
            ) from err


def _entry_json(dtype: str, piece: Piece) -> dict[str, Any]:
    doc = piece.to_json()
    del doc["file"]  # always the index's own file
    return {"dtype": dtype, "piece": doc}


def _parse(doc: Any, step: int, rank: int) -> RankIndex:
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT_NAME:
        raise ValueError(f"not a {INDEX_FORMAT_NAME} object")
    if doc["format_version"] != _INDEX_VERSION:
        raise ValueError(f"format_version {doc['format_version']!r} is not {_INDEX_VERSION}")
    if (doc["step"], doc["rank"]) != (step, rank):
        raise ValueError(f"it says step {doc['step']!r} rank {doc['rank']!r}")
    f = doc["file"]
    file = None
    files: dict[str, FileEntry] = {}
    if f is not None:
        file = IndexedFile(
            name=str(f["name"]),
            size=int(f["size"]),
            crc32=int(f["crc32"]),
            checksum_algorithm=str(f.get("checksum_algorithm", DEFAULT_CHECKSUM_ALGORITHM)),
        )
        algorithm = parse_algorithm(file.checksum_algorithm)
        files[file.name] = FileEntry(file.size, file.crc32, algorithm)

    def entries(raw: Any, what: str) -> dict[str, tuple[str, Piece]]:
        out = {}
        for key, rec in dict(raw).items():
            piece_doc = {**dict(rec["piece"]), "file": None if file is None else file.name}
            dtype = str(rec["dtype"])
            out[key] = (dtype, parse_piece(piece_doc, files, item_size(dtype), f"{what} {key!r}"))
        return out

    tensors = entries(doc["tensors"], "tensor")
    rl = dict(doc["rank_local"])
    local = entries(rl["tensors"], "rank-local tensor")
    extents = [
        (p.file, p.offset, p.offset + p.nbytes, key, i)
        for i, (key, (_, p)) in enumerate([*tensors.items(), *local.items()])
        if p.nbytes
    ]
    check_no_overlap(extents)
    return RankIndex(
        step=step,
        rank=rank,
        file=file,
        tensors=tensors,
        rank_local_trees=list(rl["trees"]),
        rank_local=local,
    )


class RankReport(NamedTuple):
    """What a rank tells the coordinator after writing (gathered; small per rank).

    The coordinator builds the top manifest from these alone: no HEAD of any file.
    """

    rank: int
    """The reporting rank."""
    index_file: FileEntry
    """Size and CRC-32 of the rank's index object."""
    file: IndexedFile | None
    """Its shard file (size, checksum), or None."""
    tensors: Mapping[str, tuple[str, tuple[int, ...], str, str, bool]]
    """key -> (dtype, global shape, kind, form, held) of each replicated or sharded tensor
    the rank holds a non-empty piece of (`held` True); the rank that sends the tree lists
    every tensor it saw, so tensors empty on every rank are known too. form is "whole",
    "flat" or "box"."""
    tree: Any = None
    """The state skeleton (one rank sends it)."""
    metrics: Mapping[str, Any] | None = None
    """User metrics (the rank that sends the tree)."""

    @classmethod
    def of(
        cls,
        index: RankIndex,
        index_entry: FileEntry,
        records: Sequence[PieceRecord],
        *,
        tree: Any = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> RankReport:
        """The report of a written index; with `tree` (the coordinator's rank) every
        replicated/sharded tensor is listed, so tensors empty on every rank are known too."""
        tensors = {
            rec.key: (
                rec.dtype,
                tuple(rec.global_shape),
                rec.kind,
                _form(rec.piece),
                rec.piece.nbytes > 0,
            )
            for rec in records
            if rec.kind != "rank_local" and (rec.piece.nbytes or tree is not None)
        }
        return cls(index.rank, index_entry, index.file, tensors, tree, metrics)


def _form(piece: Piece) -> str:
    if piece.flat_range is not None:
        return "flat"
    return "box" if piece.global_offset is not None else "whole"


def check_rank_index(manifest: Manifest, rank: int, data: bytes | bytearray) -> RankIndex:
    """Parse the bytes of one rank's index and check them against the top manifest (its
    size and CRC-32, its shard file's entry, every piece's dtype and place).

    Raises:
        CorruptCheckpointError: the index does not match the manifest or is invalid.
    """
    name = index_file_name(rank, manifest.spread_prefixes)
    entry = manifest.files.get(name)
    if entry is None:
        raise CorruptCheckpointError(f"step {manifest.step}: no index of rank {rank}")
    if len(data) != entry.size or crc32(data) != entry.crc32:
        raise CorruptCheckpointError(
            f"step {manifest.step}: {name} does not match the manifest (size {len(data)} vs "
            f"{entry.size}, or a different checksum)"
        )
    index = RankIndex.from_json(data, step=manifest.step, rank=rank)
    if index.file is not None:
        shard = manifest.files.get(index.file.name)
        if shard is None or (shard.size, shard.crc32, shard.algorithm.value) != (
            index.file.size,
            index.file.crc32,
            index.file.checksum_algorithm,
        ):
            raise CorruptCheckpointError(
                f"step {manifest.step}: {name} describes {index.file.name} differently from "
                "the manifest"
            )
    for key, (dtype, piece) in index.tensors.items():
        check_tensor_place(manifest, key, dtype, piece, f"{name}: tensor {key!r}")
    return index


def piece_of(index: RankIndex, key: str) -> Piece:
    """The piece of `key` in a holder's index.

    Raises:
        CorruptCheckpointError: the manifest names the rank as a holder, its index disagrees.
    """
    found = index.tensors.get(key)
    if found is None:
        raise CorruptCheckpointError(
            f"step {index.step}: the manifest says rank {index.rank} holds part of tensor "
            f"{key!r}, its index has no piece of it"
        )
    return found[1]


def assemble(manifest: Manifest, indexes: Mapping[int, RankIndex]) -> Manifest:
    """Merge a format-2 summary with (some of) its indexes into the complete form."""
    tensors: dict[str, dict[str, Any]] = {}
    for key, rec in manifest.tensors.items():
        pieces = [piece_of(indexes[r], key) for r in rec["ranks"] if r in indexes]
        tensors[key] = {**rec, "pieces": pieces}
    rank_local = tuple(
        {
            "trees": list(indexes[r].rank_local_trees),
            "tensors": {k: {"dtype": d, "piece": p} for k, (d, p) in indexes[r].rank_local.items()},
        }
        for r in sorted(indexes)
    )
    return dataclasses.replace(manifest, tensors=tensors, rank_local=rank_local, complete=True)
