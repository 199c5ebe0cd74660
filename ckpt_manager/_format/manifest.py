"""Checkpoint layout names and the `manifest.json` schema (build, serialise, validate).

Layout under the root::

    _LEASE.json                  the run holding the root (see `_store/lease.py`)
    _pins/step-<N:012d>          pinned steps (empty objects; `ckptctl pin` writes them too)
    step-<N:012d>/rank-<r:05d>.bin   one shard file per rank that has tensors to write
    step-<N:012d>/rank-<r:05d>.index.json  one index object per rank (format version 2, see
                                 `_format/rank_index.py`): its pieces, offsets, checksums
    step-<N:012d>/manifest.json  written last, exclusively, by the coordinator = the commit

With spreading (`CheckpointConfig.spread_prefixes`, the default on S3; [Note: request
spreading]) a rank's shard file and index sit one level down, in
`step-<N:012d>/<r % P as 2 hex digits>/`; the manifest stays at the step's top, records
`"spread_prefixes": P` after `world_size` and names those files with their sub-prefix.

Manifest format version 2 (what the save path writes), all names relative to the step folder::

    {"format": "trainingd-checkpoint", "format_version": 2, "step": N, "world_size": W,
     "run_id": str, "created_unix_s": float, "committed_unix_s": float,
     "versions": {...}, "metrics": {...},
     "files": {name: {"size": int, "crc32": int [, "checksum_algorithm": "crc32c"]}},
                                                      shard files and every rank's index
     "tree": skeleton,
     "tensors": {key: {"dtype": str, "global_shape": [...], "kind": "replicated"|"sharded",
                       "form": "whole"|"flat"|"box", "ranks": [[first, end], ...]}}}
    ... and last, "manifest_crc32": int

[Note: the top manifest stays small] Format 1 recorded every piece of every rank, empty
ones included (about 108 bytes each): 232 MiB at 1024 ranks x 2200 tensors, parsed by every
restoring rank. Format 2 keeps the pieces in the ranks' index objects and records per tensor
only the ranks holding non-empty pieces of it, as half-open runs of rank numbers (ZeRO-style
flat sharding puts a tensor on one or two consecutive ranks; a replicated tensor is on rank 0
alone), so the manifest grows with ranks + tensors, not their product. A restoring rank reads
the indexes of the ranks holding the tensors it needs, plus its own (its RankLocal state);
`rank_index.complete_manifest` reads all of them for tools that need every piece. `form` says
how the non-empty pieces place themselves (`ckptctl list` shows the strategy from it). Every
rank writes an index (W of them, each listed in `files` with its size and CRC-32, checked on
read), so verifying a step checks the indexes like any other file. A parsed format-2 manifest
is a summary (`Manifest.complete` is False: tensor records carry `ranks`, not `pieces`, and
`rank_local` is empty) until `rank_index` fills it in.

Manifest format version 1 (written before issue #18; still read, and written by `ckptctl
reshard`)::

    {"format": "trainingd-checkpoint", "format_version": 1, "step": N, "world_size": W,
     "run_id": str, "created_unix_s": float, "committed_unix_s": float,
     "versions": {"trainingd": str, "torch": str, "python": str}, "metrics": {...},
     "files": {name: {"size": int, "crc32": int, "checksum_algorithm": "crc32c"}},
     "tree": skeleton (see `_format/tree.py`),
     "tensors": {key: {"dtype": str, "global_shape": [...], "kind": "replicated"|"sharded",
                       "pieces": [piece, ...]}},
     "rank_local": [{"trees": [skeleton, ...], "tensors": {key: {"dtype": str, "piece": piece}}}]}
    piece = {"file": name, "offset": int, "nbytes": int, "shape": [...],
             "global_offset": [...] | null, "flat_range": [start, end] | null}
    ... and last, "manifest_crc32": int (see below)

A file record's `crc32` holds its checksum by `checksum_algorithm` (`_format/checksum.py`);
records without that field (every manifest before it existed) are CRC-32, and the field is
only written for other algorithms, so CRC-32 records serialise as they always did.

Parsing validates everything a reader will touch, so a manifest that parses never makes a
reader fetch bytes outside a piece or allocate more than the step's files hold:

- names: no `..`, no absolute paths, no other prefixes (only a two-hex-digit sub-folder, and
  only when `spread_prefixes` is recorded);
- every piece's extent: `nbytes` is what its dtype and shape hold, `offset` is 64-byte aligned
  (`format.plan_layout` places every tensor so), `[offset, offset + nbytes)` lies inside the
  file's recorded size and overlaps no other piece of that file;
- every piece's place in its tensor: a flat range holds as many elements as the piece's shape
  and lies inside the global shape, a box has the global shape's rank and lies inside it, a
  piece with neither is the whole tensor (empty pieces may claim any place, see
  [Note: empty pieces anywhere] in `_format/tree.py`);
- every global shape holds at most as many bytes as the step's files together, so
  consolidating a tensor never allocates more than is stored (the file sizes themselves are
  checked against storage by `steps.verify_files` before anything is read).

[Note: the manifest's own checksum] The last field, `manifest_crc32`, is the CRC-32 (zlib's)
of the canonical serialisation of everything else: the document without that field as
`json.dumps(doc, separators=(",", ":"))` writes it, keys in stored order. The writer's
bytes are exactly that serialisation with `,"manifest_crc32":N}` in place of the closing
brace, so a reader checks the raw bytes (as fast as reading them); a manifest re-serialised
by a tool (indented, say) is checked against a fresh canonical serialisation of its parsed
content instead. A mismatch is a corrupt manifest: bit rot or an edit that the extent checks
alone could miss (a flipped digit that still fits, a changed metric). Manifests written
before the field existed have none and are read with the other checks only; the field does
not change `format_version`, as readers of version 1 ignore unknown top-level keys.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ckpt_manager._format.checksum import ChecksumAlgorithm, crc32, parse_algorithm
from ckpt_manager._format.dtypes import item_size
from ckpt_manager._format.names import validate_relative_name
from ckpt_manager.errors import CorruptCheckpointError

__all__ = [
    "CHECKSUM_FIELD",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSION_PIECES",
    "MANIFEST_NAME",
    "MAX_SPREAD_PREFIXES",
    "PIECE_ALIGN_BYTES",
    "PINS_DIR",
    "SPREAD_FIELD",
    "FileEntry",
    "Manifest",
    "Piece",
    "check_no_overlap",
    "check_tensor_place",
    "index_file_name",
    "parse_piece",
    "parse_step_dir",
    "rank_runs",
    "shard_file_name",
    "spread_prefix",
    "step_dir",
]

FORMAT_NAME = "trainingd-checkpoint"
FORMAT_VERSION = 2
"""What the save path writes: a top manifest plus per-rank index objects."""
FORMAT_VERSION_PIECES = 1
"""Every piece in the manifest itself (read, and written by `ckptctl reshard`)."""
TENSOR_FORMS = ("whole", "flat", "box")
"""How a tensor's non-empty pieces place themselves (format 2's `form`)."""
MANIFEST_NAME = "manifest.json"
PINS_DIR = "_pins"
CHECKSUM_FIELD = "manifest_crc32"
"""Top-level field holding the manifest's own checksum ([Note: the manifest's own checksum])."""
PIECE_ALIGN_BYTES = 64
"""Every piece starts at a multiple of this in its file (`format.plan_layout` places them)."""
SPREAD_FIELD = "spread_prefixes"
"""Top-level field (format 2, only when non-zero): the sub-prefixes the step's rank objects
are spread over ([Note: request spreading])."""
MAX_SPREAD_PREFIXES = 256
"""Most sub-prefixes a step may spread over (two hex digits name each)."""
_STEP_RE = re.compile(r"^step-(\d{12})$")
_SPREAD_DIR_RE = re.compile(r"^[0-9a-f]{2}$")


def step_dir(step: int) -> str:
    """Folder name of a step: `step-000000001000` (zero-padded, so names sort as numbers)."""
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """Step number of a folder name, or None if it is not a step folder."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def spread_prefix(rank: int, spread_prefixes: int) -> str:
    """The sub-prefix of a rank's objects inside the step folder: `""` without spreading,
    else two hex digits of `rank % spread_prefixes` and a slash (`"0a/"`).

    [Note: request spreading] S3 sustains about 3,500 PUT-class requests per second per key
    prefix and splits a busy prefix into partitions over time; a 1024-rank save makes about
    2,000 to 20,000 PUT-class requests (shards, their multipart parts, indexes) within
    seconds, all under `step-<N>/`, so it is throttled with SlowDown replies. Spreading puts
    rank r's shard file and index under `step-<N>/<r % P as 2 hex digits>/`, so a save
    touches P distinct prefixes and S3 can serve each from its own partition. Consecutive
    ranks (one node's) land in different prefixes; the names are distinct for every bucket,
    which is all S3's range partitioning needs (it no longer asks for random prefixes). The
    step folder stays the unit of commit, listing and deletion: the manifest stays at its
    top, records `spread_prefixes` and names every file with its sub-prefix, and removal is
    recursive. Local disk and `memory://` gain nothing from it and use plain names.
    """
    if spread_prefixes == 0:
        return ""
    return f"{rank % spread_prefixes:02x}/"


def shard_file_name(rank: int, spread_prefixes: int = 0) -> str:
    """Shard file name of a rank, relative to the step folder: `rank-00003.bin`, or
    `03/rank-00003.bin` when spread ([Note: request spreading])."""
    return f"{spread_prefix(rank, spread_prefixes)}rank-{rank:05d}.bin"


def index_file_name(rank: int, spread_prefixes: int = 0) -> str:
    """Index object name of a rank (format version 2), relative to the step folder:
    `rank-00003.index.json`, or `03/rank-00003.index.json` when spread."""
    return f"{spread_prefix(rank, spread_prefixes)}rank-{rank:05d}.index.json"


def rank_runs(ranks: Iterable[int]) -> list[list[int]]:
    """Sorted distinct ranks as half-open runs: `[0, 1, 2, 7]` -> `[[0, 3], [7, 8]]`."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return runs


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


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A committed step's manifest (see the module docstring for the JSON form)."""

    step: int
    """Training step."""
    world_size: int
    """Ranks that saved it."""
    run_id: str
    """Run that saved it."""
    created_unix_s: float
    """When `save()` was called."""
    committed_unix_s: float
    """When the manifest was written."""
    versions: Mapping[str, str]
    """trainingd, torch and python versions of the writer."""
    metrics: Mapping[str, Any]
    """User metrics."""
    files: Mapping[str, FileEntry]
    """Shard files with size and crc32."""
    tree: Any
    """State skeleton."""
    tensors: Mapping[str, Mapping[str, Any]]
    """Replicated and sharded tensors: dtype, global shape, kind, pieces (`Piece`)."""
    rank_local: tuple[Mapping[str, Any], ...]
    """Per saved rank: RankLocal skeletons and tensors (`{"dtype", "piece"}`); empty in a
    format-2 summary."""
    format_version: int = FORMAT_VERSION_PIECES
    """1: every piece in the manifest; 2: a top manifest over per-rank index objects."""
    complete: bool = True
    """Whether `tensors` carry their `pieces` and `rank_local` is filled in (False for a
    format-2 manifest as read: [Note: the top manifest stays small])."""
    spread_prefixes: int = 0
    """Sub-prefixes the rank objects are spread over (0: plain names in the step folder;
    [Note: request spreading])."""

    def holders(self, key: str) -> tuple[int, ...]:
        """Ranks holding non-empty pieces of a tensor (a format-2 summary only).

        Raises:
            KeyError: no such tensor.
        """
        return tuple(self.tensors[key]["ranks"])

    def form_of(self, key: str) -> str:
        """How a tensor's non-empty pieces place themselves: "whole", "flat" or "box"."""
        rec = self.tensors[key]
        if "form" in rec:
            return str(rec["form"])
        stored = [p for p in rec["pieces"] if p.nbytes]
        if any(p.flat_range is not None for p in stored):
            return "flat"
        return "box" if any(p.global_offset is not None for p in stored) else "whole"

    @property
    def num_bytes(self) -> int:
        """Total bytes of the step's files."""
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        """Serialise (UTF-8 JSON) in its format: format 2 as the top manifest only (a
        completed one too: its pieces stay in the index objects), format 1 with every piece."""
        if self.format_version == FORMAT_VERSION:
            return self._top_json()

        def tensor_json(rec: Mapping[str, Any]) -> dict[str, Any]:
            return {**rec, "pieces": [p.to_json() for p in rec["pieces"]]}

        doc = {
            **self._summary_json(FORMAT_VERSION_PIECES),
            "tensors": {k: tensor_json(v) for k, v in self.tensors.items()},
            "rank_local": [
                {
                    "trees": rl["trees"],
                    "tensors": {
                        k: {"dtype": v["dtype"], "piece": v["piece"].to_json()}
                        for k, v in rl["tensors"].items()
                    },
                }
                for rl in self.rank_local
            ],
        }
        # Compact: `ckptctl list` reads one manifest per step, and a manifest grows with
        # ranks x tensors; indentation made them 2.3x larger and 25% slower to parse.
        body = _canonical(doc)
        return body[:-1] + _checksum_suffix(crc32(body))

    def _summary_json(self, version: int) -> dict[str, Any]:
        """The fields both formats open with, in their on-storage order (up to the tree)."""
        return {
            "format": FORMAT_NAME,
            "format_version": version,
            "step": self.step,
            "world_size": self.world_size,
            **self._spread_json(),
            "run_id": self.run_id,
            "created_unix_s": self.created_unix_s,
            "committed_unix_s": self.committed_unix_s,
            "versions": dict(self.versions),
            "metrics": dict(self.metrics),
            "files": {n: f.to_json() for n, f in self.files.items()},
            "tree": self.tree,
        }

    def _spread_json(self) -> dict[str, int]:
        # Only when spread: a plain step's manifest stays byte for byte what it was.
        return {SPREAD_FIELD: self.spread_prefixes} if self.spread_prefixes else {}

    def _top_json(self) -> bytes:
        doc = {
            **self._summary_json(FORMAT_VERSION),
            "tensors": {
                k: {
                    "dtype": v["dtype"],
                    "global_shape": list(v["global_shape"]),
                    "kind": v["kind"],
                    "form": v["form"],
                    "ranks": rank_runs(v["ranks"]),
                }
                for k, v in self.tensors.items()
            },
        }
        body = _canonical(doc)
        return body[:-1] + _checksum_suffix(crc32(body))

    @classmethod
    def from_json(cls, data: bytes, *, expected_step: int | None = None) -> Manifest:
        """Parse and validate.

        Raises:
            CorruptCheckpointError: not JSON, wrong format, or any field fails validation.
        """
        try:
            doc = json.loads(data)
            damage = _checksum_problem(data, doc)
            try:
                manifest = _parse(doc, expected_step)
            except (ValueError, TypeError, KeyError, IndexError) as err:
                if damage is None:
                    raise
                raise ValueError(f"{damage}; its content is invalid too: {err}") from err
            if damage is not None:
                raise ValueError(damage)
            return manifest
        except CorruptCheckpointError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as err:
            where = f"step {expected_step}" if expected_step is not None else "manifest"
            raise CorruptCheckpointError(f"invalid manifest of {where}: {err}") from err


def _canonical(doc: Mapping[str, Any]) -> bytes:
    """The serialisation the manifest checksum covers (and the one `to_json` writes)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def _checksum_suffix(value: int) -> bytes:
    return b',"%s":%d}' % (CHECKSUM_FIELD.encode(), value)


def _checksum_problem(data: bytes, doc: Any) -> str | None:
    """Remove `doc`'s checksum and say what is wrong with it, if anything.

    See [Note: the manifest's own checksum]; a manifest without the field has no problem here.
    """
    if not isinstance(doc, dict) or CHECKSUM_FIELD not in doc:
        return None
    stored = doc.pop(CHECKSUM_FIELD)
    if not _is_count(stored) or stored > 0xFFFFFFFF:
        return f"{CHECKSUM_FIELD} must be a CRC-32 (an integer < 2**32), got {stored!r}"
    raw = memoryview(data.rstrip(b" \t\r\n"))
    suffix = _checksum_suffix(stored)
    if raw[-len(suffix) :] == suffix and crc32(b"}", crc32(raw[: -len(suffix)])) == stored:
        return None  # as written: the bytes before the field are the canonical form
    actual = crc32(_canonical(doc))
    if actual == stored:
        return None
    return (
        f"manifest checksum {stored:#010x} does not match its content ({actual:#010x}): the "
        "manifest was damaged or edited after it was committed"
    )


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list")
    return tuple(_int(v, what) for v in value)


def _file_name(value: Any, spread_prefixes: int) -> str:
    name = validate_relative_name(value)
    if "/" in name:
        # A spread step's rank objects sit one level down, in a two-hex-digit sub-prefix.
        head, _, tail = name.partition("/")
        if not (spread_prefixes and _SPREAD_DIR_RE.match(head) and "/" not in tail):
            raise ValueError(f"file name {name!r} must be inside the step folder")
    return name


def _spread(doc: Mapping[str, Any]) -> int:
    value = _int(doc.get(SPREAD_FIELD, 0), SPREAD_FIELD)
    if value > MAX_SPREAD_PREFIXES:
        raise ValueError(f"{SPREAD_FIELD} {value} is above {MAX_SPREAD_PREFIXES}")
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
    if not (_is_count(offset) and _is_count(nbytes)):
        raise ValueError(f"{what}: offset {offset!r} and nbytes {nbytes!r} must be integers >= 0")
    shape = _shape(doc["shape"], what)
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
            and _is_count(flat[0])
            and _is_count(flat[1])
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
        None if box is None else _shape(box, what),
        None if flat is None else (flat[0], flat[1]),
    )


def _check_box(piece: Piece, global_shape: tuple[int, ...], what: str) -> None:
    """A non-empty piece that is not flat lies inside its tensor (see the module docstring)."""
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


# (file, first byte, end byte, tensor key, piece index or -1 - rank for a rank-local tensor)
_Extent = tuple[str, int, int, str, int]


def _describe(extent: _Extent) -> str:
    key, index = extent[3], extent[4]
    if index >= 0:
        return f"tensor {key!r} piece {index}"
    return f"rank-local tensor {key!r} of rank {-1 - index}"


def check_no_overlap(extents: list[_Extent]) -> None:
    """No two non-empty pieces share a byte of the same file.

    Args:
        extents: `(file, first byte, end byte, tensor key, piece index)` per non-empty piece.

    Raises:
        ValueError: two extents overlap.
    """
    extents.sort()
    for a, b in itertools.pairwise(extents):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(f"{_describe(a)} and {_describe(b)} overlap in file {a[0]!r}")


def _check_global_shape(what: str, dtype: str, shape: tuple[int, ...], stored_bytes: int) -> int:
    """Elements of a tensor; its bytes must fit in the step's files (restore allocates it)."""
    numel = math.prod(shape)
    if numel * item_size(dtype) > stored_bytes:
        raise ValueError(
            f"{what}: global shape {shape} needs {numel * item_size(dtype)} bytes, more "
            f"than the {stored_bytes} bytes of the step's files"
        )
    return numel


def _ranks(value: Any, world_size: int, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what}: ranks must be a list of [first, end] runs")
    out: list[int] = []
    for run in value:
        if not (isinstance(run, list) and len(run) == 2 and all(_is_count(r) for r in run)):
            raise ValueError(f"{what}: rank run {run!r} must be [first, end]")
        first, end = run
        if not (first < end <= world_size) or (out and first <= out[-1]):
            raise ValueError(
                f"{what}: rank run {run!r} is empty, unsorted or outside world size {world_size}"
            )
        out.extend(range(first, end))
    return tuple(out)


def _parse_top(
    doc: Mapping[str, Any], step: int, files: dict[str, FileEntry], spread: int
) -> Manifest:
    """Format 2: the summary; pieces stay in the index objects ([Note: the top manifest
    stays small])."""
    world_size = _int(doc["world_size"], "world_size", 1)
    for rank in range(world_size):
        if index_file_name(rank, spread) not in files:
            raise ValueError(f"the index of rank {rank} is not listed in files")
    stored_bytes = sum(f.size for f in files.values())
    tensors: dict[str, dict[str, Any]] = {}
    for key, rec in dict(doc["tensors"]).items():
        what = f"tensor {key!r}"
        dtype = str(rec["dtype"])
        if rec["kind"] not in ("replicated", "sharded"):
            raise ValueError(f"{what}: unknown kind {rec['kind']!r}")
        if rec["form"] not in TENSOR_FORMS:
            raise ValueError(f"{what}: unknown form {rec['form']!r}")
        shape = _shape(rec["global_shape"], f"{what} global_shape")
        _check_global_shape(what, dtype, shape, stored_bytes)
        tensors[key] = {
            "dtype": dtype,
            "global_shape": list(shape),
            "kind": rec["kind"],
            "form": rec["form"],
            "ranks": _ranks(rec["ranks"], world_size, what),
        }
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError("metrics must be an object")
    return Manifest(
        step=step,
        world_size=world_size,
        run_id=str(doc["run_id"]),
        created_unix_s=float(doc["created_unix_s"]),
        committed_unix_s=float(doc["committed_unix_s"]),
        versions={str(k): str(v) for k, v in dict(doc.get("versions") or {}).items()},
        metrics=metrics,
        files=files,
        tree=doc["tree"],
        tensors=tensors,
        rank_local=(),
        format_version=FORMAT_VERSION,
        complete=False,
        spread_prefixes=spread,
    )


def check_tensor_place(manifest: Manifest, key: str, dtype: str, piece: Piece, what: str) -> None:
    """A non-empty piece from an index fits its tensor as the top manifest records it.

    Raises:
        CorruptCheckpointError: unknown tensor, another dtype, or a place outside the whole.
    """
    rec = manifest.tensors.get(key)
    try:
        if rec is None:
            raise ValueError("the manifest has no such tensor")
        if rec["dtype"] != dtype:
            raise ValueError(f"dtype {dtype} differs from the manifest's {rec['dtype']}")
        global_shape = tuple(rec["global_shape"])
        flat = piece.flat_range
        if flat is None:
            _check_box(piece, global_shape, what)
        elif flat[1] > math.prod(global_shape):
            raise ValueError(f"flat_range {list(flat)} lies outside global shape {global_shape}")
    except ValueError as err:
        raise CorruptCheckpointError(f"step {manifest.step}: {what}: {err}") from err


def _parse(doc: Any, expected_step: int | None) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ValueError(f"not a {FORMAT_NAME} manifest")
    version = _int(doc["format_version"], "format_version", 1)
    if version > FORMAT_VERSION:
        raise ValueError(f"format_version {version} is newer than supported {FORMAT_VERSION}")
    step = _int(doc["step"], "step")
    if expected_step is not None and step != expected_step:
        raise ValueError(f"manifest says step {step}, folder says {expected_step}")
    spread = _spread(doc)
    files = {
        _file_name(n, spread): FileEntry(
            _int(f["size"], "size"),
            _int(f["crc32"], "crc32"),
            parse_algorithm(f.get("checksum_algorithm")),
        )
        for n, f in dict(doc["files"]).items()
    }
    if version == FORMAT_VERSION:
        return _parse_top(doc, step, files, spread)
    stored_bytes = sum(f.size for f in files.values())
    extents: list[_Extent] = []
    tensors: dict[str, dict[str, Any]] = {}
    for key, rec in dict(doc["tensors"]).items():
        what = f"tensor {key!r}"
        itemsize = item_size(rec["dtype"])
        if rec["kind"] not in ("replicated", "sharded"):
            raise ValueError(f"{what}: unknown kind {rec['kind']!r}")
        global_shape = _shape(rec["global_shape"], f"{what} global_shape")
        numel = math.prod(global_shape)
        if numel * itemsize > stored_bytes:
            # Checked before any piece: restore allocates the whole tensor to consolidate it.
            raise ValueError(
                f"{what}: global shape {global_shape} needs {numel * itemsize} bytes, more "
                f"than the {stored_bytes} bytes of the step's files"
            )
        pieces = []
        for i, p in enumerate(rec["pieces"]):
            piece = parse_piece(p, files, itemsize, what)
            if piece.nbytes:  # empty pieces may claim any place
                flat = piece.flat_range
                if flat is None:
                    _check_box(piece, global_shape, what)
                elif flat[1] > numel:
                    raise ValueError(
                        f"{what}: flat_range {list(flat)} lies outside the {numel} elements of "
                        f"global shape {global_shape}"
                    )
                extents.append((piece.file, piece.offset, piece.offset + piece.nbytes, key, i))
            pieces.append(piece)
        tensors[key] = {
            "dtype": rec["dtype"],
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
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError("metrics must be an object")
    return Manifest(
        step=step,
        world_size=_int(doc["world_size"], "world_size", 1),
        run_id=str(doc["run_id"]),
        created_unix_s=float(doc["created_unix_s"]),
        committed_unix_s=float(doc["committed_unix_s"]),
        versions={str(k): str(v) for k, v in dict(doc.get("versions") or {}).items()},
        metrics=metrics,
        files=files,
        tree=doc["tree"],
        tensors=tensors,
        rank_local=tuple(rank_local),
        spread_prefixes=spread,
    )
