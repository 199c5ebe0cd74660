"""Export a step as Hugging Face-style sharded safetensors: shard files plus their index.

`ckptctl restore --format safetensors --max-shard-size 2GB --to DIR` writes
`DIR/model-00001-of-00003.safetensors` ... and `DIR/model.safetensors.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {name: file}}`), the layout
`transformers` and `trainingd run --init-from` read. Tensors are packed in tree order; a new
shard starts when the next tensor would pass the limit, and a tensor larger than the limit
gets a shard of its own (as `transformers` does). Each shard carries the same
`__metadata__` as the single-file export (step, run id, plain values).
"""

from __future__ import annotations

import json
import os
import re

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.export import (
    Selection,
    Streamer,
    safetensors_metadata,
    safetensors_sources,
    write_safetensors_file,
)
from ckpt_manager.ctl.render import Progress

__all__ = ["INDEX_NAME", "export_sharded_safetensors", "parse_size"]

INDEX_NAME = "model.safetensors.index.json"
"""The index file of the Hugging Face sharded layout."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes of a size such as `2GB` (10^9), `500MB`, `1.5GiB` (2^30) or `1048576`.

    Raises:
        UsageError: not a positive size with a known unit.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"--max-shard-size {text!r}: use a number with an optional unit, e.g. 2GB, "
            "500MB, 1GiB or 1048576"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise UsageError(f"--max-shard-size {text!r}: use at least 1 byte")
    return size


def export_sharded_safetensors(
    storage: Storage,
    m: Manifest,
    sel: Selection,
    directory: str,
    *,
    max_shard_bytes: int,
    chunk_bytes: int,
    progress: Progress,
) -> tuple[int, int]:
    """Write the selection as sharded safetensors + index under local `directory`.

    Returns:
        `(tensors written, shard files written)`.

    Raises:
        UsageError: a dtype safetensors cannot hold.
    """
    sources = safetensors_sources(m, sel)
    shards: list[list[int]] = []
    size = 0
    for i, (_, src) in enumerate(sources):
        if not shards or (shards[-1] and size + src.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += src.nbytes
    if not shards:
        shards.append([])
    os.makedirs(directory, exist_ok=True)
    metadata = safetensors_metadata(m, sel)
    streamer = Streamer(storage, m, chunk_bytes, progress)
    weight_map: dict[str, str] = {}
    for number, members in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        chosen = [sources[i] for i in members]
        write_safetensors_file(streamer, chosen, os.path.join(directory, file_name), metadata)
        weight_map.update((name, file_name) for name, _ in chosen)
    index = {
        "metadata": {"total_size": sum(src.nbytes for _, src in sources)},
        "weight_map": weight_map,
    }
    # The index is written last, through a temporary name: a reader that finds it finds
    # every shard it names complete.
    tmp = os.path.join(directory, f".{INDEX_NAME}.tmp")
    with open(tmp, "w") as out:
        json.dump(index, out, indent=2)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, os.path.join(directory, INDEX_NAME))
    return len(sources), len(shards)
