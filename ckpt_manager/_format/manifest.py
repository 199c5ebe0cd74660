"""The top manifest (`step-<N>/manifest.json`, format version 2): model, serialisation, checks.

The save path writes only this format; format 1 (every piece inline, before issue #18) is
still read, by `_format/legacy_v1.py`, into the same `Manifest` model. All names are relative
to the step folder (`_format/layout.py`)::

    {"format": "trainingd-checkpoint", "format_version": 2, "step": N, "world_size": W,
     ["spread_prefixes": P,]
     "run_id": str, "created_unix_s": float, "committed_unix_s": float,
     "versions": {"trainingd": str, "torch": str, "python": str, "platform": str},
     "metrics": {...},
     "files": {name: file record},    shard files and every rank's index (`_format/pieces.py`)
     "tree": skeleton (see `_format/tree.py`),
     "tensors": {key: {"dtype": str, "global_shape": [...], "kind": "replicated"|"sharded",
                       "form": "whole"|"flat"|"box", "ranks": [[first, end], ...]}}}
    ... and last, "manifest_crc32": int

`spread_prefixes` is written only when non-zero ([Note: request spreading] in
`_format/layout.py`); the files of a spread step are named with their sub-prefix.

[Note: the top manifest stays small] Format 1 recorded every piece of every rank, empty
ones included (about 108 bytes each): 232 MiB at 1024 ranks x 2200 tensors, parsed by every
restoring rank. Format 2 keeps the pieces in the ranks' index objects and records per tensor
only the ranks holding non-empty pieces of it, as half-open runs of rank numbers (ZeRO-style
flat sharding puts a tensor on one or two consecutive ranks; a replicated tensor is on rank 0
alone), so the manifest grows with ranks + tensors, not their product. A restoring rank reads
the indexes of the ranks holding the tensors it needs, plus its own (its RankLocal state);
`indexes.complete_manifest` reads all of them for tools that need every piece. `form` says
how the non-empty pieces place themselves (`ckptctl list` shows the strategy from it). Every
rank writes an index (W of them, each listed in `files` with its size and CRC-32, checked on
read), so verifying a step checks the indexes like any other file.

The model: a parsed format-2 manifest is a summary (`Manifest.complete` is False: tensor
records carry `ranks` and `form`, not `pieces`, and `rank_local` is empty) until
`rank_index.assemble` fills in the pieces from the indexes. A format-1 manifest is read
complete (`pieces` and `rank_local` straight from the document).

Parsing validates everything a reader will touch: the names (`layout.check_step_file_name`),
the pieces and global shapes (`_format/pieces.py`), and for format 2 that every rank's index
is listed and every `ranks` run lies inside the world size.

[Note: the manifest's own checksum] The last field, `manifest_crc32`, is the CRC-32 (zlib's)
of the canonical serialisation of everything else: the document without that field as
`json.dumps(doc, separators=(",", ":"))` writes it, keys in stored order. The writer's
bytes are exactly that serialisation with `,"manifest_crc32":N}` in place of the closing
brace, so a reader checks the raw bytes (as fast as reading them); a manifest re-serialised
by a tool (indented, say) is checked against a fresh canonical serialisation of its parsed
content instead. A mismatch is a corrupt manifest: bit rot or an edit that the extent checks
alone could miss (a flipped digit that still fits, a changed metric). Manifests written
before the field existed (format 1 only) have none and are read with the other checks only;
the field does not change `format_version`, as readers of version 1 ignore unknown top-level
keys.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ckpt_manager._format import legacy_v1
from ckpt_manager._format.checksum import crc32, parse_algorithm
from ckpt_manager._format.layout import MAX_SPREAD_PREFIXES, check_step_file_name, index_file_name
from ckpt_manager._format.pieces import (
    FileEntry,
    Piece,
    as_count,
    check_place,
    is_count,
    parse_tensor_head,
)
from ckpt_manager.errors import CorruptCheckpointError

__all__ = [
    "CHECKSUM_FIELD",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "SPREAD_FIELD",
    "TENSOR_FORMS",
    "EncodedTensors",
    "Manifest",
    "check_tensor_place",
    "rank_runs",
]

FORMAT_NAME = "trainingd-checkpoint"
FORMAT_VERSION = 2
"""What the save path writes: a top manifest plus per-rank index objects."""
TENSOR_FORMS = ("whole", "flat", "box")
"""How a tensor's non-empty pieces place themselves (format 2's `form`)."""
CHECKSUM_FIELD = "manifest_crc32"
"""Top-level field holding the manifest's own checksum ([Note: the manifest's own checksum])."""
SPREAD_FIELD = "spread_prefixes"
"""Top-level field (only when non-zero): the sub-prefixes the step's rank objects are spread
over ([Note: request spreading] in `_format/layout.py`)."""


def rank_runs(ranks: Iterable[int]) -> list[list[int]]:
    """Sorted distinct ranks as half-open runs: `[0, 1, 2, 7]` -> `[[0, 3], [7, 8]]`."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return runs


def _tensor_records_json(tensors: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A format-2 manifest's `tensors` object, as `Manifest.to_json` writes it."""
    return {
        k: {
            "dtype": v["dtype"],
            "global_shape": list(v["global_shape"]),
            "kind": v["kind"],
            "form": v["form"],
            "ranks": rank_runs(v["ranks"]),
        }
        for k, v in tensors.items()
    }


class EncodedTensors(Mapping[str, Mapping[str, Any]]):
    """A top manifest's tensor records, read-only, with their JSON encoded once.

    The coordinator's commit reuses one while every rank's tensor list is unchanged
    ([Note: the top manifest's tensor records are reused] in `_save/commit.py`);
    `Manifest.to_json` splices `json` in instead of encoding the records again. Nothing
    mutates the records (they are shared by the manifests of successive steps).
    """

    def __init__(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """Wrap `records` (a format-2 summary's: dtype, global_shape, kind, form, ranks)."""
        self._records = dict(records)
        self.json = json.dumps(
            _tensor_records_json(self._records), separators=(",", ":"), allow_nan=True
        ).encode()
        """The records as `Manifest.to_json` writes them (compact JSON)."""

    def __getitem__(self, key: str) -> Mapping[str, Any]:
        return self._records[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


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
    """Shard files and rank indexes with size and checksum."""
    tree: Any
    """State skeleton."""
    tensors: Mapping[str, Mapping[str, Any]]
    """Replicated and sharded tensors: dtype, global shape, kind; a summary's records carry
    `form` and `ranks` (the holders), a complete one's `pieces` (`Piece`) too."""
    rank_local: tuple[Mapping[str, Any], ...]
    """Per saved rank: RankLocal skeletons and tensors (`{"dtype", "piece"}`); empty in a
    summary."""
    format_version: int = FORMAT_VERSION
    """The format it was read from: 2 (what is written), or 1 (`_format/legacy_v1.py`)."""
    complete: bool = False
    """Whether `tensors` carry their `pieces` and `rank_local` is filled in (False for a
    format-2 manifest as built or read: [Note: the top manifest stays small])."""
    spread_prefixes: int = 0
    """Sub-prefixes the rank objects are spread over (0: plain names in the step folder;
    [Note: request spreading] in `_format/layout.py`)."""

    def holders(self, key: str) -> tuple[int, ...]:
        """Ranks holding non-empty pieces of a tensor (a format-2 manifest only).

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
        """Serialise as the top manifest (UTF-8 JSON, format 2; a completed manifest too:
        its pieces stay in the index objects).

        Raises:
            ValueError: a manifest read from format 1 (read, never written).
        """
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"step {self.step}: a format-{self.format_version} manifest is read, never "
                f"written (the writer emits format {FORMAT_VERSION})"
            )
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            # Only when spread: a plain step's manifest stays byte for byte what it was.
            **({SPREAD_FIELD: self.spread_prefixes} if self.spread_prefixes else {}),
            "run_id": self.run_id,
            "created_unix_s": self.created_unix_s,
            "committed_unix_s": self.committed_unix_s,
            "versions": dict(self.versions),
            "metrics": dict(self.metrics),
            "files": {n: f.to_json() for n, f in self.files.items()},
            "tree": self.tree,
        }
        # Compact: `ckptctl list` reads one manifest per step; indentation made format 1's
        # manifests 2.3x larger and 25% slower to parse.
        if isinstance(self.tensors, EncodedTensors):
            # The last field: its encoded form spliced in, byte for byte what encoding it
            # here would give ([Note: the top manifest's tensor records are reused]).
            body = _canonical(doc)[:-1] + b',"tensors":' + self.tensors.json + b"}"
        else:
            doc["tensors"] = _tensor_records_json(self.tensors)
            body = _canonical(doc)
        return body[:-1] + _checksum_suffix(crc32(body))

    @classmethod
    def from_json(cls, data: bytes, *, expected_step: int | None = None) -> Manifest:
        """Parse and validate a manifest of either format (format 1 by `legacy_v1`).

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
    if not is_count(stored) or stored > 0xFFFFFFFF:
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


def _spread(doc: Mapping[str, Any]) -> int:
    value = as_count(doc.get(SPREAD_FIELD, 0), SPREAD_FIELD)
    if value > MAX_SPREAD_PREFIXES:
        raise ValueError(f"{SPREAD_FIELD} {value} is above {MAX_SPREAD_PREFIXES}")
    return value


def _ranks(value: Any, world_size: int, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what}: ranks must be a list of [first, end] runs")
    out: list[int] = []
    for run in value:
        if not (isinstance(run, list) and len(run) == 2 and all(is_count(r) for r in run)):
            raise ValueError(f"{what}: rank run {run!r} must be [first, end]")
        first, end = run
        if not (first < end <= world_size) or (out and first <= out[-1]):
            raise ValueError(
                f"{what}: rank run {run!r} is empty, unsorted or outside world size {world_size}"
            )
        out.extend(range(first, end))
    return tuple(out)


def _summary_tensors(
    doc: Mapping[str, Any], world_size: int, files: Mapping[str, FileEntry], spread: int
) -> dict[str, dict[str, Any]]:
    """Format 2's tensor records ([Note: the top manifest stays small]); every rank's index
    must be listed among `files`."""
    for rank in range(world_size):
        if index_file_name(rank, spread) not in files:
            raise ValueError(f"the index of rank {rank} is not listed in files")
    stored_bytes = sum(f.size for f in files.values())
    tensors: dict[str, dict[str, Any]] = {}
    for key, rec in dict(doc["tensors"]).items():
        what = f"tensor {key!r}"
        dtype, shape = parse_tensor_head(key, rec, stored_bytes)
        if rec["form"] not in TENSOR_FORMS:
            raise ValueError(f"{what}: unknown form {rec['form']!r}")
        tensors[key] = {
            "dtype": dtype,
            "global_shape": list(shape),
            "kind": rec["kind"],
            "form": rec["form"],
            "ranks": _ranks(rec["ranks"], world_size, what),
        }
    return tensors


def _parse(doc: Any, expected_step: int | None) -> Manifest:
    """Both formats: the fields they share here, the tensor records by version."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ValueError(f"not a {FORMAT_NAME} manifest")
    version = as_count(doc["format_version"], "format_version", 1)
    if version > FORMAT_VERSION:
        raise ValueError(f"format_version {version} is newer than supported {FORMAT_VERSION}")
    step = as_count(doc["step"], "step")
    if expected_step is not None and step != expected_step:
        raise ValueError(f"manifest says step {step}, folder says {expected_step}")
    spread = _spread(doc)
    files = {
        check_step_file_name(n, spread): FileEntry(
            as_count(f["size"], "size"),
            as_count(f["crc32"], "crc32"),
            parse_algorithm(f.get("checksum_algorithm")),
        )
        for n, f in dict(doc["files"]).items()
    }
    world_size = as_count(doc["world_size"], "world_size", 1)
    if version == FORMAT_VERSION:
        tensors = _summary_tensors(doc, world_size, files, spread)
        rank_local: tuple[Mapping[str, Any], ...] = ()
    elif version == legacy_v1.FORMAT_VERSION_PIECES:
        tensors, rank_local = legacy_v1.parse_pieces(doc, files)
    else:
        raise ValueError(f"format_version {version} is not one this reader knows")
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
        rank_local=rank_local,
        format_version=version,
        complete=version != FORMAT_VERSION,
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
        check_place(piece, tuple(rec["global_shape"]), what)
    except ValueError as err:
        raise CorruptCheckpointError(f"step {manifest.step}: {what}: {err}") from err
