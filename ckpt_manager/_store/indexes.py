"""Rank index objects on storage: written by each rank's writer, read back checked.

What an index's bytes mean is `_format/rank_index.py`; this module only moves them.
"""

from __future__ import annotations

import json

from ckpt_manager._format.checksum import crc32
from ckpt_manager._format.layout import index_file_name, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._format.rank_index import RankIndex, assemble, check_rank_index
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError

__all__ = ["complete_manifest", "read_rank_index", "write_finished_index"]


def write_finished_index(
    storage: Storage, index_json: str, size: int, crc: int, *, spread_prefixes: int = 0
) -> FileEntry:
    """Write a pending index (`RankIndex.to_json` with its shard size and checksum still 0)
    with the shard file's final `size` and `crc` (in its sub-prefix when `spread_prefixes`);
    returns the index's own size and CRC-32.

    Used by the writer process after the shard file is durable, and by the trainer for a
    rank without a shard file; torch-free and cheap (no piece is re-validated: the trainer
    built them).
    """
    doc = json.loads(index_json)
    if doc["file"] is not None:
        doc["file"]["size"], doc["file"]["crc32"] = size, crc
    data = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    name = index_file_name(int(doc["rank"]), spread_prefixes)
    storage.write(f"{step_dir(int(doc['step']))}/{name}", data)
    return FileEntry(len(data), crc32(data))


def read_rank_index(storage: Storage, manifest: Manifest, rank: int) -> RankIndex:
    """Read one rank's index of a format-2 step, checked against the top manifest's entry.

    Raises:
        CorruptCheckpointError: the index is missing from the manifest, damaged (size or
            CRC differ from the manifest's), or invalid.
        StorageError: the read failed.
    """
    name = index_file_name(rank, manifest.spread_prefixes)
    if name not in manifest.files or not 0 <= rank < manifest.world_size:
        raise CorruptCheckpointError(f"step {manifest.step}: no index of rank {rank}")
    return check_rank_index(manifest, rank, storage.read(f"{step_dir(manifest.step)}/{name}"))


def complete_manifest(storage: Storage, manifest: Manifest) -> Manifest:
    """A format-2 manifest with every rank's pieces filled in (reads every index).

    For tools that need every piece (`ckptctl show`, export, reshard); a format-1 manifest
    is complete already and comes back as it is.

    Raises:
        CorruptCheckpointError: an index is missing, damaged or invalid.
        StorageError: a read failed.
    """
    if manifest.complete:
        return manifest
    indexes: dict[int, RankIndex] = {}
    errors: list[CheckpointError] = []
    for rank in range(manifest.world_size):
        try:
            indexes[rank] = read_rank_index(storage, manifest, rank)
        except CheckpointError as err:
            errors.append(err)
    if errors:
        raise errors[0]
    return assemble(manifest, indexes)
