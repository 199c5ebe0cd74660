"""Consolidate a sharded step into one full state dict: `torch.save` or safetensors file.

Selection (`--only KEY`, repeatable) keeps top-level entries of the saved state; with one
key its subtree becomes the file's top level, so `--only model` gives exactly what
`model.load_state_dict` takes. RankLocal subtrees (per-rank RNG states, data positions) have
no meaning in a single consolidated file and are left out (reported on stderr).

torch format: `torch.save` writes the archive with empty storage records, then each tensor
is streamed into its record (see [Note: torch.save without the tensors in memory]); the
output loads with `torch.load(weights_only=True)`. Tied names listed under `__aliases__`
become keys sharing their target's tensor, so a strict `load_state_dict` accepts the file.
safetensors: the header is computed from the manifest and tensors are streamed straight into
the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import ALIASES_KEY
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.render import Progress
from ckpt_manager.ctl.stream import TensorSource, stream_range, tensor_bytes
from ckpt_manager.errors import CorruptCheckpointError

__all__ = [
    "Selection",
    "Streamer",
    "export_safetensors",
    "export_torch",
    "safetensors_metadata",
    "safetensors_sources",
    "select",
    "with_aliases",
    "write_safetensors_file",
]

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class Selection(NamedTuple):
    """The part of a step's skeleton to export."""

    tree: Any
    """Skeleton node that becomes the file's top level."""
    skipped: list[str]
    """Paths of RankLocal subtrees left out."""


def select(m: Manifest, only: Sequence[str]) -> Selection:
    """Pick top-level entries of the saved state.

    Raises:
        UsageError: a key is not a top-level entry (the message lists the ones there are).
    """
    tree = m.tree
    if only:
        if tree[0] != "d":
            raise UsageError(f"--only needs a dict at the top of the state; step {m.step} has none")
        entries = {str(k): v for k, v in tree[1]}
        missing = [k for k in only if k not in entries]
        if missing:
            raise UsageError(
                f"--only {', '.join(missing)}: not in step {m.step}; top-level keys are "
                f"{', '.join(entries) or '(none)'}"
            )
        tree = entries[only[0]] if len(only) == 1 else ["d", [[k, entries[k]] for k in only]]
    skipped: list[str] = []
    return Selection(_drop_rank_local(tree, "", skipped), skipped)


def _drop_rank_local(node: Any, path: str, skipped: list[str]) -> Any:
    tag, body = node[0], node[1]
    if tag == "d":
        kept = []
        for k, child in body:
            sub = f"{path}/{k}" if path else str(k)
            if child[0] == "R":
                skipped.append(sub)
                continue
            kept.append([k, _drop_rank_local(child, sub, skipped)])
        return ["d", kept]
    if tag in ("l", "t"):
        out = []
        for i, child in enumerate(body):
            sub = f"{path}/{i}" if path else str(i)
            if child[0] == "R":
                skipped.append(sub)
                out.append(["v", None])
            else:
                out.append(_drop_rank_local(child, sub, skipped))
        return [tag, out]
    if tag == "R":
        skipped.append(path or "<root>")
        return ["v", None]
    return node


def tensors_of(tree: Any, prefix: str = "") -> list[tuple[str, str]]:
    """`(name in the exported file, manifest key)` of every tensor, in tree order."""
    out: list[tuple[str, str]] = []
    tag, body = tree[0], tree[1]
    if tag in ("T", "S"):
        out.append((prefix, body))
    elif tag == "d":
        for k, child in body:
            out += tensors_of(child, f"{prefix}/{k}" if prefix else str(k))
    elif tag in ("l", "t"):
        for i, child in enumerate(body):
            out += tensors_of(child, f"{prefix}/{i}" if prefix else str(i))
    return out


class Streamer:
    """Streams whole tensors of a step into an open file, chunk by chunk."""

    def __init__(self, storage: Storage, m: Manifest, chunk_bytes: int, progress: Progress):
        self.storage = storage
        self.m = m
        self.chunk_bytes = chunk_bytes
        self.progress = progress
        self.prefetch = storage.capabilities.read_prefetch

    def write_tensor(self, src: TensorSource, out: Any) -> None:
        with ThreadPoolExecutor(
            max_workers=max(1, self.prefetch), thread_name_prefix="ckptctl-read"
        ) as pool:
            for chunk in stream_range(
                self.storage,
                self.m,
                src,
                0,
                src.numel,
                chunk_bytes=self.chunk_bytes,
                prefetch=self.prefetch,
                pool=pool if self.prefetch else None,
            ):
                data = tensor_bytes(chunk)
                out.write(data)
                self.progress.advance(len(data))


def export_safetensors(
    storage: Storage,
    m: Manifest,
    sel: Selection,
    path: str,
    *,
    chunk_bytes: int,
    progress: Progress,
) -> int:
    """Write the selection as a safetensors file at local `path`; returns tensors written.

    Plain values of the state go into the header's `__metadata__` (as JSON under
    `trainingd.values`) since safetensors holds only tensors.

    Raises:
        UsageError: a dtype safetensors cannot hold.
    """
    sources = safetensors_sources(m, sel)
    streamer = Streamer(storage, m, chunk_bytes, progress)
    write_safetensors_file(streamer, sources, path, safetensors_metadata(m, sel))
    return len(sources)


def safetensors_sources(m: Manifest, sel: Selection) -> list[tuple[str, TensorSource]]:
    """`(name, source)` of every tensor of the selection, in tree order.

    Raises:
        UsageError: a dtype safetensors cannot hold.
    """
    out = []
    for name, key in tensors_of(sel.tree):
        src = TensorSource.of_manifest(m, key)
        if src.dtype not in _SAFETENSORS_DTYPES:
            raise UsageError(
                f"tensor {name!r} has dtype {src.dtype}, which safetensors cannot hold; "
                "use --format torch"
            )
        out.append((name, src))
    return out


def safetensors_metadata(m: Manifest, sel: Selection) -> dict[str, str]:
    """The `__metadata__` of our safetensors files: step, run id and the plain values."""
    return {
        "format": "pt",
        "trainingd.step": str(m.step),
        "trainingd.run_id": m.run_id,
        "trainingd.values": json.dumps(_values_only(sel.tree)),
    }


def write_safetensors_file(
    streamer: Streamer,
    sources: Sequence[tuple[str, TensorSource]],
    path: str,
    metadata: dict[str, str],
) -> None:
    """One safetensors file of `sources` at local `path`, streamed, fsynced."""
    header: dict[str, Any] = {}
    cursor = 0
    for name, src in sources:
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[src.dtype],
            "shape": list(src.global_shape),
            "data_offsets": [cursor, cursor + src.nbytes],
        }
        cursor += src.nbytes
    header["__metadata__"] = metadata
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(body)))
        out.write(body)
        for _, src in sources:
            streamer.write_tensor(src, out)
        out.flush()
        os.fsync(out.fileno())


def _values_only(node: Any) -> Any:
    tag, body = node[0], node[1]
    if tag == "v":
        return body
    if tag == "d":
        kept = {str(k): _values_only(v) for k, v in body if v[0] not in ("T", "S")}
        return {k: v for k, v in kept.items() if v not in ({}, [])}
    if tag in ("l", "t"):
        return [_values_only(v) for v in body if v[0] not in ("T", "S")]
    return None


def export_torch(
    storage: Storage,
    m: Manifest,
    sel: Selection,
    path: str,
    *,
    chunk_bytes: int,
    progress: Progress,
) -> int:
    """Write the selection with `torch.save` at local `path`; returns tensors written.

    [Note: torch.save without the tensors in memory] `torch.save` runs under
    `torch.serialization.skip_data()` on placeholder tensors (`torch.empty`: address space,
    no resident pages), which writes the archive with every storage record reserved but
    empty. The records are stored uncompressed; their offsets are read from the zip
    directory and each tensor is streamed into its record. Storage keys follow the order
    pickle meets the tensors, which is the order `build` creates them (each has its own
    storage); sizes are checked record by record.
    """
    sources: list[TensorSource] = []

    def build(node: Any) -> Any:
        tag, body = node[0], node[1]
        if tag == "v":
            return body
        if tag == "d":
            return with_aliases({k: build(v) for k, v in body})
        if tag in ("l", "t"):
            items = [build(v) for v in body]
            return tuple(items) if tag == "t" else items
        src = TensorSource.of_manifest(m, body)
        sources.append(src)
        return torch.empty(src.global_shape, dtype=src.dtype)

    state = build(sel.tree)
    with torch.serialization.skip_data():
        torch.save(state, path)
    del state
    records = _storage_records(path)
    if sorted(records) != list(range(len(sources))):
        raise CorruptCheckpointError(
            f"{path}: torch.save wrote {len(records)} storages for {len(sources)} tensors"
        )
    streamer = Streamer(storage, m, chunk_bytes, progress)
    with open(path, "r+b") as out:
        for key, src in enumerate(sources):
            offset, size = records[key]
            if size != src.nbytes:
                raise CorruptCheckpointError(
                    f"{path}: storage {key} holds {size} bytes, tensor {src.key!r} has {src.nbytes}"
                )
            out.seek(offset)
            streamer.write_tensor(src, out)
        out.flush()
        os.fsync(out.fileno())
    return len(sources)


def with_aliases(d: dict[str, Any]) -> dict[str, Any]:
    """Resolve a state dict's `ALIASES_KEY` (`{tied name: saved name}`, CONTRACTS.md).

    Each alias becomes a key holding the very tensor of its target (one storage in the
    archive, shared after `torch.load`, as in a tied module's own `state_dict()`), so a
    strict `load_state_dict` finds every name. Entries that do not name a tensor of the same
    dict are left out.
    """
    aliases = d.get(ALIASES_KEY)
    if not isinstance(aliases, dict):
        return d
    out = {k: v for k, v in d.items() if k != ALIASES_KEY}
    for alias, target in aliases.items():
        if isinstance(target, str) and isinstance(out.get(target), torch.Tensor):
            out.setdefault(str(alias), out[target])
    return out


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50


def _storage_records(path: str) -> dict[int, tuple[int, int]]:
    """`{storage key: (data offset, size)}` of the `data/<key>` records of a torch archive."""
    out: dict[int, tuple[int, int]] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            head, _, key = info.filename.rpartition("/")
            if not head.endswith("/data") or not key.isdigit():
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(f"{path}: storage {key} is compressed")
            raw.seek(info.header_offset)
            fields = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
            if fields[0] != _LOCAL_HEADER_MAGIC:
                raise CorruptCheckpointError(f"{path}: bad zip local header for storage {key}")
            name_len, extra_len = fields[9], fields[10]
            offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            out[int(key)] = (offset, info.file_size)
    return out


def selected_bytes(m: Manifest, sel: Selection) -> int:
    """Bytes of the tensors in the selection."""
    total = 0
    for _, key in tensors_of(sel.tree):
        rec = m.tensors[key]
        total += math.prod(rec["global_shape"]) * TensorSource.of_manifest(m, key).dtype.itemsize
    return total
