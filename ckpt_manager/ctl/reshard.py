"""Reshard a committed step for another world size: a new checkpoint of N rank files.

The output is an ordinary committed step (same layout, shard format and manifest, built
with `format.plan_layout`, `commit.build_contribution` / `merge_manifest`), so
`CheckpointManager.restore` on N ranks reads it like one it wrote itself:

* sharded tensors: new rank r holds flat range `[r*c, (r+1)*c)` of the flattened whole,
  `c = ceil(numel / N)` (empty ranges are not stored);
* replicated tensors: rank 0, whole;
* RankLocal subtrees: new rank r gets saved rank r's (ranks beyond the saved world get
  none and keep their template's values on restore; saved ranks beyond N are dropped).

Each rank file is streamed into a local temporary (bounded memory, see [Note: bounded
memory] in `ctl/stream.py`), checksummed while written, and published; the manifest is
written last, exclusively, which commits the step at the destination.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import torch

from ckpt_manager._format.checksum import crc32
from ckpt_manager._format.manifest import MANIFEST_NAME, Manifest, shard_file_name, step_dir
from ckpt_manager._format.shard_file import dtype_from_name, plan_layout
from ckpt_manager._format.tree import Flattened, LeafKind, TensorLeaf
from ckpt_manager._save.commit import build_contribution, merge_manifest
from ckpt_manager._store.steps import remove_uncommitted_step
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.render import Progress
from ckpt_manager.ctl.stream import TensorSource, stream_range, tensor_bytes
from ckpt_manager.errors import ObjectExistsError

__all__ = ["ReshardPlan", "plan_reshard", "write_resharded"]


@dataclasses.dataclass(frozen=True)
class _Part:
    leaf: TensorLeaf  # a meta tensor: only dtype and shape are used for the layout
    src: TensorSource
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """What each new rank stores."""

    world_size: int
    """New world size."""
    parts: tuple[tuple[_Part, ...], ...]
    """Per new rank, the tensor ranges it stores (file order)."""
    rank_local_trees: tuple[list[Any], ...]
    """Per new rank, its RankLocal skeletons (empty past the saved world)."""
    num_bytes: int
    """Tensor bytes to write."""
    dropped_ranks: int
    """Saved ranks whose RankLocal state has no new rank."""


def _meta(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def plan_reshard(m: Manifest, world_size: int) -> ReshardPlan:
    """Decide which new rank stores which ranges."""
    parts: list[list[_Part]] = [[] for _ in range(world_size)]
    total = 0
    for key, rec in m.tensors.items():
        src = TensorSource.of(key, rec["dtype"], rec["global_shape"], rec["pieces"])
        if rec["kind"] == "replicated":
            leaf = TensorLeaf(
                key,
                LeafKind.REPLICATED,
                _meta(src.dtype, src.global_shape),
                src.global_shape,
                None,
                None,
            )
            parts[0].append(_Part(leaf, src, 0, src.numel))
            total += src.nbytes
            continue
        per = -(-src.numel // world_size)
        for r in range(world_size):
            a, b = min(src.numel, r * per), min(src.numel, (r + 1) * per)
            if a == b and not (r == 0 and src.numel == 0):
                continue
            leaf = TensorLeaf(
                key, LeafKind.SHARDED, _meta(src.dtype, (b - a,)), src.global_shape, None, (a, b)
            )
            parts[r].append(_Part(leaf, src, a, b))
            total += (b - a) * src.dtype.itemsize
    trees: list[list[Any]] = []
    for r in range(world_size):
        if r >= len(m.rank_local):
            trees.append([])
            continue
        rl = m.rank_local[r]
        trees.append(list(rl["trees"]))
        for key, rec in rl["tensors"].items():
            piece = rec["piece"]
            dtype = dtype_from_name(rec["dtype"])
            src = TensorSource.of(
                key,
                rec["dtype"],
                piece.shape,
                [dataclasses.replace(piece, global_offset=None, flat_range=None)],
            )
            leaf = TensorLeaf(
                key, LeafKind.RANK_LOCAL, _meta(dtype, piece.shape), piece.shape, None, None
            )
            parts[r].append(_Part(leaf, src, 0, src.numel))
            total += src.nbytes
    return ReshardPlan(
        world_size,
        tuple(tuple(p) for p in parts),
        tuple(trees),
        total,
        max(0, len(m.rank_local) - world_size),
    )


def _write_file(
    storage: Storage,
    m: Manifest,
    parts: tuple[_Part, ...],
    out: BinaryIO,
    chunk_bytes: int,
    progress: Progress,
) -> tuple[Any, int, int]:
    layout = plan_layout(
        [(p.leaf.key, p.leaf.tensor.dtype, tuple(p.leaf.tensor.shape)) for p in parts]
    )
    crc = crc32(layout.header)
    out.write(layout.header)
    written = len(layout.header)
    prefetch = storage.capabilities.read_prefetch
    with ThreadPoolExecutor(
        max_workers=max(1, prefetch), thread_name_prefix="ckptctl-read"
    ) as pool:
        for part, slot in zip(parts, layout.slots, strict=True):
            gap = slot.offset - written
            if gap:
                out.write(b"\x00" * gap)
                crc = crc32(b"\x00" * gap, crc)
                written += gap
            for chunk in stream_range(
                storage,
                m,
                part.src,
                part.start,
                part.end,
                chunk_bytes=chunk_bytes,
                prefetch=prefetch,
                pool=pool if prefetch else None,
            ):
                data = tensor_bytes(chunk)
                out.write(data)
                crc = crc32(data, crc)
                written += len(data)
                progress.advance(len(data))
    assert written == layout.total_bytes, (written, layout.total_bytes)
    return layout, written, crc


def write_resharded(
    source: Storage,
    m: Manifest,
    dest: Storage,
    plan: ReshardPlan,
    *,
    chunk_bytes: int,
    progress: Progress,
) -> Manifest:
    """Write the resharded step under `dest` and commit it (manifest last, exclusive).

    Raises:
        ObjectExistsError: the step is already committed at the destination.
        StorageError: a read or write failed (nothing is committed then).
    """
    folder = step_dir(m.step)
    if dest.exists(f"{folder}/{MANIFEST_NAME}"):
        raise ObjectExistsError(17, f"{dest.root_uri}: step {m.step} is already committed there")
    # A leftover of an interrupted earlier attempt is never committed: start clean.
    if not remove_uncommitted_step(dest, m.step):  # committed since the look above
        raise ObjectExistsError(17, f"{dest.root_uri}: step {m.step} is already committed there")
    contributions = []
    for r in range(plan.world_size):
        parts = plan.parts[r]
        skeleton = Flattened(m.tree, plan.rank_local_trees[r], [p.leaf for p in parts])
        name = shard_file_name(r) if parts else None
        fd, tmp = tempfile.mkstemp(prefix=f"ckptctl-rank{r}-", dir=_tmp_dir(dest))
        try:
            with os.fdopen(fd, "wb") as out:
                layout, size, crc = _write_file(source, m, parts, out, chunk_bytes, progress)
            if name is not None:
                dest.put_file(tmp, f"{folder}/{name}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        contribution = build_contribution(
            r, skeleton, [p.leaf for p in parts], layout, name, m.metrics
        )
        contribution.update(size=size if name else 0, crc32=crc if name else 0)
        contributions.append(contribution)
        progress.advance(num_files=1)
    merged = merge_manifest(
        step=m.step,
        run_id=m.run_id,
        created_unix_s=m.created_unix_s,
        committed_unix_s=time.time(),
        contributions=contributions,
    )
    saved_world = len(m.rank_local)
    merged = dataclasses.replace(
        merged, rank_local=merged.rank_local[: min(saved_world, plan.world_size)]
    )
    dest.write(f"{folder}/{MANIFEST_NAME}", merged.to_json(), exclusive=True)
    return merged


def _tmp_dir(dest: Storage) -> str | None:
    """Temporaries beside a local destination (same disk), else the system temp folder."""
    if dest.capabilities.local_paths:
        os.makedirs(dest.path(), exist_ok=True)
        return dest.path()
    return None
