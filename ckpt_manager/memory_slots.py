"""The memory tier's slot files, for a process that moves snapshots between nodes.

A public module, imported explicitly (its names are not in `ckpt_manager.__all__`). trainingd's
daemon streams each rank's complete snapshots to a peer node and copies them back after a node
loss (`daemon/agent/replica/`); it reads and writes the slots through these names only:

    SlotFiles     one rank's payload and meta files in a directory (allocation with
                  `posix_fallocate`, atomic metas)
    SlotMeta      a parsed, self-checked meta (run id, rank, world size, step, layouts,
                  checksum, origin)
    parsed_metas  the metas of `SlotFiles.read_metas()` that parse, with their JSON objects
    restamp       a meta with fields added and its self-check renewed (a replica's stamps)
    ParsedMeta, parse_meta_file, stamp
                  a meta read from its file's bytes (checked on those bytes: no re-encoding),
                  and `restamp` for it, encoded once ([Note: a signed meta's text is checked
                  as it is] in `ckpt_manager/_memory/meta.py`)
    MetaReader    a directory's complete metas, each file version parsed once (for a thread
                  that polls them)
    verify_slot   why a payload does not match its meta's checksum (None: it does)
    ORIGIN_REPLICA  the `origin` of a slot copied from a peer: the restore then reports
                  `RestoreResult.source == "replica"`
    write_kept_step  ask this node's ranks to keep their snapshot of a step (the one the
                  peer's replica it holds has: [Note: a node keeps the step its peer's replica
                  holds] in `ckpt_manager/_memory/keep.py`)

See [Note: the memory tier] in `ckpt_manager/_memory/__init__.py`.
"""

from __future__ import annotations

from ckpt_manager._memory.keep import write_kept_step
from ckpt_manager._memory.load import verify_slot
from ckpt_manager._memory.meta import (
    ORIGIN_LOCAL,
    ORIGIN_REPLICA,
    ParsedMeta,
    SlotMeta,
    parse_meta_file,
    parsed_metas,
    restamp,
    stamp,
)
from ckpt_manager._memory.meta_reader import MetaReader
from ckpt_manager._memory.slots import SlotFiles

__all__ = [
    "ORIGIN_LOCAL",
    "ORIGIN_REPLICA",
    "MetaReader",
    "ParsedMeta",
    "SlotFiles",
    "SlotMeta",
    "parse_meta_file",
    "parsed_metas",
    "restamp",
    "stamp",
    "verify_slot",
    "write_kept_step",
]
