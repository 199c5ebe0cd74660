"""A memory slot's meta: the JSON written next to a complete payload.

    {"format": "trainingd-memory-slot", "format_version": 1,
     "run_id": str, "rank": int, "world_size": int, "step": int, "created_unix_s": float,
     "payload_bytes": int, "durable_bytes": int,
     "checksum_algorithm": "crc32c", "checksum": int,      (of payload bytes [0, payload_bytes))
     "layout": hex, "global_layout": hex,                 (`plan.layout_fingerprints`)
     "tree": skeleton, "rank_local_trees": [skeleton, ...],  (`_format/tree.py`)
     "tensors": {key: [kind, dtype, shape, global_shape, global_offset | null,
                       flat_range | null, offset, nbytes], ...},   (flatten order)
     ["replicate": false,]                                  (kept off the peer ring)
     ["origin": "replica", "replica_round": int, "replica_node": int,]   (a peer's copy)
     "meta_checksum": int}     CRC-32C of the canonical JSON (sorted keys) of the rest

The skeleton holds the non-tensor values (loader position, counters, RNG seeds as ints);
tensors are named by key and found in the payload through `tensors`. `SlotMeta.parse` checks
the shape of everything a restore uses, and the meta's own checksum (the skeleton's values
are restored from it, so a flipped bit there must not pass either), so a meta that a bit
flip broke is refused with a reason instead of raising in the middle of a load or restoring a
wrong value.

A meta with `"replicate": false` describes a snapshot its rank keeps on its own node only:
the daemon's replica sender passes over it ([Note: under `auto` a durable save between two
snapshots stays on its node] in `daemon/rank/memory_cadence.py`). A meta without the field (all
of them before it existed) is replicated.

A meta without `origin` describes a snapshot this node's rank took; `restamp` (`stamp` for a
meta already parsed from its file) adds the fields a copy of it carries once a peer node holds
it (`daemon/agent/replica/`), with a fresh `meta_checksum`, so a restore from such a slot says
it came from a replica.

[Note: a signed meta's text is checked as it is] A meta's file is written in its signed form:
the canonical text of the body (sorted keys, no spaces) with `,"meta_checksum":N}` in place of
its closing brace (`MetaEncoder`, `stamp`). `parse_meta_file` then checks the self-checksum on
those bytes: the CRC-32C of the text before that trailer, closed with `}`, must be N. The text
was the canonical JSON of the body when it was signed, so equal CRCs say it still is (up to
CRC-32C's collisions, the same bound as the check by re-encoding). Re-encoding a parsed body
(`SlotMeta.parse` on a dict) costs a full `json.dumps` with sorted keys: 0.5 ms for the
default job's 49 KB meta, 4 of them per replica that crossed the daemon, whose replica
threads held the GIL for it against each other ([Note: a replica costs one parse at each
end] in `daemon/agent/replica/sender.py`). A meta in another form (written by hand, or by an
older version with `json.dumps` unsorted) is still checked by re-encoding.
"""

from __future__ import annotations

import json
import time
from typing import Any, NamedTuple

from ckpt_manager._format.checksum import ChecksumAlgorithm, checksum, parse_algorithm
from ckpt_manager._memory.plan import MemoryPlan, TensorRecord

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ORIGIN_LOCAL",
    "ORIGIN_REPLICA",
    "MetaEncoder",
    "ParsedMeta",
    "SlotMeta",
    "parse_meta_file",
    "parsed_metas",
    "restamp",
    "stamp",
]

FORMAT = "trainingd-memory-slot"
FORMAT_VERSION = 1
_SELF_CHECK = "meta_checksum"
_REPLICATE = "replicate"
ORIGIN_LOCAL = "memory"
"""`SlotMeta.origin` of a snapshot taken on this node."""
ORIGIN_REPLICA = "replica"
"""`SlotMeta.origin` of a snapshot copied from a peer node's replica."""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _meta_checksum(body: dict[str, Any]) -> int:
    return _crc32c(_canonical(body).encode())


def _crc32c(data: bytes) -> int:
    return checksum(ChecksumAlgorithm.CRC32C, data)


_TRAILER_KEY = b',"' + _SELF_CHECK.encode() + b'":'


def _signed(text: bytes, value: int) -> bytes:
    """The canonical text `text` of a body, whose CRC-32C is `value`, in its signed form (the
    file's bytes)."""
    return text[:-1] + _TRAILER_KEY + b"%d}" % value


def _signed_text_verifies(text: bytes, stored: Any) -> bool:
    """Whether `text` is a meta file in its signed form whose CRC matches `stored` (the value
    its JSON holds): [Note: a signed meta's text is checked as it is]."""
    start = text.rfind(_TRAILER_KEY)
    if start < 0 or type(stored) is not int or text[start + len(_TRAILER_KEY) :] != b"%d}" % stored:
        return False
    return _crc32c(text[:start] + b"}") == stored


class SlotMeta(NamedTuple):
    """A parsed meta (see the module docstring)."""

    run_id: str
    rank: int
    world_size: int
    step: int
    payload_bytes: int
    algorithm: ChecksumAlgorithm
    checksum: int
    layout: str
    global_layout: str
    tree: Any
    rank_local_trees: list[Any]
    records: dict[str, TensorRecord]
    origin: str = ORIGIN_LOCAL
    """`ORIGIN_LOCAL`, or `ORIGIN_REPLICA` for a copy a peer node held (`restamp`)."""
    replicate: bool = True
    """Whether the peer ring replicates it (False: it stays on its node)."""

    @classmethod
    def parse(cls, raw: dict[str, Any], *, text: bytes | None = None) -> SlotMeta:
        """Check and parse a meta.

        Args:
            raw: the meta's JSON object.
            text: the file's bytes `raw` was parsed from, if the caller has them: a signed
                text is checked as it is, without encoding `raw` again ([Note: a signed
                meta's text is checked as it is]).

        Raises:
            ValueError: not a meta of this format, or a field is missing or malformed.
        """
        if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"not a {FORMAT} v{FORMAT_VERSION} meta (format {raw.get('format')!r} "
                f"v{raw.get('format_version')!r})"
            )
        if text is None or not _signed_text_verifies(text, raw.get(_SELF_CHECK)):
            body = {k: v for k, v in raw.items() if k != _SELF_CHECK}
            if raw.get(_SELF_CHECK) != _meta_checksum(body):
                raise ValueError("meta checksum mismatch")
        try:
            records = {
                str(key): _record(value, int(raw["payload_bytes"]))
                for key, value in raw["tensors"].items()
            }
            trees = raw["rank_local_trees"]
            if not isinstance(trees, list):
                raise ValueError("rank_local_trees is not a list")
            replicate = raw.get(_REPLICATE, True)
            if not isinstance(replicate, bool):
                raise ValueError(f"replicate is not true or false: {replicate!r}")
            return cls(
                run_id=str(raw["run_id"]),
                rank=int(raw["rank"]),
                world_size=int(raw["world_size"]),
                step=int(raw["step"]),
                payload_bytes=int(raw["payload_bytes"]),
                algorithm=parse_algorithm(raw["checksum_algorithm"]),
                checksum=int(raw["checksum"]),
                layout=str(raw["layout"]),
                global_layout=str(raw["global_layout"]),
                tree=raw["tree"],
                rank_local_trees=trees,
                records=records,
                origin=str(raw.get("origin", ORIGIN_LOCAL)),
                replicate=replicate,
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed meta: {type(err).__name__}: {err}") from err


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ValueError(f"expected a list of ints, got {value!r}")
    return tuple(value)


def _record(value: Any, payload_bytes: int) -> TensorRecord:
    kind, dtype, shape, global_shape, offset_, flat, offset, nbytes = value
    record = TensorRecord(
        str(kind),
        str(dtype),
        _ints(shape),
        _ints(global_shape),
        None if offset_ is None else _ints(offset_),
        None if flat is None else (int(flat[0]), int(flat[1])),
        int(offset),
        int(nbytes),
    )
    if record.offset < 0 or record.nbytes < 0 or record.offset + record.nbytes > payload_bytes:
        raise ValueError(f"tensor bytes [{record.offset}, +{record.nbytes}) outside the payload")
    return record


class MetaEncoder:
    """Encodes metas as the bytes of their file, the plan's tensor records once per plan.

    [Note: a meta is encoded once, its records once per plan] A snapshot's meta used to be
    encoded twice (the canonical JSON of its self-checksum, then the file's JSON), all of it,
    on the staging thread while the training thread runs Python that needs the GIL. Its bulk,
    `tensors` (the records: one per leaf, the same for every snapshot of one layout), is now
    encoded once per plan; each snapshot encodes only its small fields and its skeleton, once.
    The file holds the canonical text (sorted keys, no spaces) with `meta_checksum` appended,
    so `SlotMeta.parse` recomputes the same checksum from what it reads.
    """

    def __init__(self) -> None:
        """An encoder with an empty cache (one per memory tier: the staging thread's)."""
        self._plan: MemoryPlan | None = None
        self._records = ""

    def encode(
        self,
        *,
        run_id: str,
        rank: int,
        world_size: int,
        step: int,
        plan: MemoryPlan,
        algorithm: ChecksumAlgorithm,
        checksum: int,
        tree: Any,
        rank_local_trees: list[Any],
        replicate: bool = True,
    ) -> bytes:
        """The meta file's bytes of a complete payload (see the module docstring); `replicate`
        False marks a snapshot the peer ring passes over (the field is written only then)."""
        if plan is not self._plan:
            # Tuples here are lists once parsed: the same JSON text, so the same checksum.
            self._records = _canonical({key: list(r) for key, r in plan.records.items()})
            self._plan = plan
        fields: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "run_id": run_id,
            "rank": rank,
            "world_size": world_size,
            "step": step,
            "created_unix_s": time.time(),
            "payload_bytes": plan.payload.total_bytes,
            "durable_bytes": plan.durable_bytes,
            "checksum_algorithm": algorithm.value,
            "checksum": checksum,
            "layout": plan.layout,
            "global_layout": plan.global_layout,
            "tree": tree,
            "rank_local_trees": rank_local_trees,
        }
        if not replicate:
            fields[_REPLICATE] = False
        parts = {key: _canonical(value) for key, value in fields.items()}
        parts["tensors"] = self._records
        text = "{" + ",".join(f"{_canonical(k)}:{parts[k]}" for k in sorted(parts)) + "}"
        data = text.encode()
        return _signed(data, _crc32c(data))


class ParsedMeta(NamedTuple):
    """A meta read from its file: parsed, its JSON object and the file's bytes."""

    meta: SlotMeta
    """The parsed meta."""
    raw: dict[str, Any]
    """Its JSON object."""
    data: bytes
    """The file's bytes (what a replica sends, and what a changed file is compared with)."""


def parse_meta_file(data: bytes) -> ParsedMeta:
    """A meta file's bytes, parsed and checked (a signed text without re-encoding it:
    [Note: a signed meta's text is checked as it is]).

    Raises:
        ValueError: not JSON, not an object, or not a valid meta (`SlotMeta.parse`).
    """
    raw = json.loads(data)
    if not isinstance(raw, dict):
        raise ValueError("meta is not a JSON object")
    return ParsedMeta(SlotMeta.parse(raw, text=data), raw, data)


def stamp(parsed: ParsedMeta, **fields: Any) -> ParsedMeta:
    """`parsed` (already checked) with `fields` added or replaced, signed afresh and encoded
    once, in the signed form a later `parse_meta_file` checks without re-encoding.

    Raises:
        ValueError: the stamped meta is not valid (a field replaced with a malformed value).
    """
    body = {k: v for k, v in parsed.raw.items() if k != _SELF_CHECK}
    body.update(fields)
    text = _canonical(body).encode()
    value = _crc32c(text)
    data = _signed(text, value)
    raw = {**body, _SELF_CHECK: value}
    return ParsedMeta(SlotMeta.parse(raw, text=data), raw, data)


def parsed_metas(
    raw_metas: dict[int, dict[str, Any] | str],
) -> dict[int, tuple[SlotMeta, dict[str, Any]]]:
    """The metas of `SlotFiles.read_metas()` that parse, by slot, with their JSON objects (a
    torn, foreign or bit-flipped meta is left out, as if its slot were empty)."""
    found: dict[int, tuple[SlotMeta, dict[str, Any]]] = {}
    for slot, raw in raw_metas.items():
        if not isinstance(raw, dict):
            continue
        try:
            found[slot] = (SlotMeta.parse(raw), raw)
        except ValueError:
            continue
    return found


def restamp(raw: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """`raw` (a meta that `SlotMeta.parse` accepts) with `fields` added or replaced and its
    `meta_checksum` computed afresh.

    Raises:
        ValueError: `raw` is not a valid meta (checked first: a broken meta is never
            re-signed).
    """
    SlotMeta.parse(raw)
    body = {k: v for k, v in raw.items() if k != _SELF_CHECK}
    body.update(fields)
    return {**body, _SELF_CHECK: _meta_checksum(body)}
