"""Where a checkpoint's objects sit under its root: the names, and nothing else.

Layout under the root::

    _LEASE.json                  the run holding the root (see `_store/lease.py`)
    _CATALOG.json                the index of committed steps (see `_store/root_catalog.py`)
    _pins/step-<N:012d>          pinned steps (empty objects; `ckptctl pin` writes them too)
    step-<N:012d>/rank-<r:05d>.bin   one shard file per rank that has tensors to write
                                 (`_format/shard_file.py`)
    step-<N:012d>/rank-<r:05d>.index.json  one index object per rank (`_format/rank_index.py`):
                                 its pieces, offsets, checksums
    step-<N:012d>/manifest.json  written last, exclusively, by the coordinator = the commit
                                 (`_format/manifest.py`)
    _quarantine/step-<N:012d>-<UTC time>-<run>/  a step a restore found corrupt, moved aside
                                 as found, with `QUARANTINE.json` (`_store/quarantine.py`)

With spreading (`CheckpointConfig.spread_prefixes`, the default on S3; [Note: request
spreading]) a rank's shard file and index sit one level down, in
`step-<N:012d>/<r % P as 2 hex digits>/`; the manifest stays at the step's top, records
`"spread_prefixes": P` and names those files with their sub-prefix.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt_manager._format.names import validate_relative_name

__all__ = [
    "MANIFEST_NAME",
    "MAX_SPREAD_PREFIXES",
    "PIECE_ALIGN_BYTES",
    "PINS_DIR",
    "check_step_file_name",
    "index_file_name",
    "parse_step_dir",
    "shard_file_name",
    "spread_prefix",
    "step_dir",
]

MANIFEST_NAME = "manifest.json"
PINS_DIR = "_pins"
PIECE_ALIGN_BYTES = 64
"""Every piece starts at a multiple of this in its file (`shard_file.plan_layout` places
them; manifest validation rejects any other offset)."""
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
    """Index object name of a rank, relative to the step folder: `rank-00003.index.json`, or
    `03/rank-00003.index.json` when spread."""
    return f"{spread_prefix(rank, spread_prefixes)}rank-{rank:05d}.index.json"


def check_step_file_name(name: Any, spread_prefixes: int) -> str:
    """A file name read from a manifest: relative, and inside the step folder (in a
    two-hex-digit sub-prefix only when the step records `spread_prefixes`).

    Raises:
        ValueError: anything else (another prefix, `..`, an absolute path).
    """
    checked = validate_relative_name(name)  # checks that it is a string too
    if "/" in checked:
        # A spread step's rank objects sit one level down, in a two-hex-digit sub-prefix.
        head, _, tail = checked.partition("/")
        if not (spread_prefixes and _SPREAD_DIR_RE.match(head) and "/" not in tail):
            raise ValueError(f"file name {checked!r} must be inside the step folder")
    return checked
