"""Reshard a committed step for another world size: a new checkpoint of N rank files.

The output is an ordinary committed step, written the way a save writes one (format 2: a
shard file and an index object per new rank, then a small top manifest) with the save path's
own building blocks (`shard_file.plan_layout`, `plan.piece_records`, `report.prepare_rank`,
`indexes.write_finished_index`, `commit.build_top_manifest`), and committed through the one
commit path, `publish.publish_manifest` (lease fence, exclusive manifest write, root catalog
record). `CheckpointManager.restore` on N ranks reads it like one it wrote itself:

* sharded tensors: new rank r holds flat range `[r*c, (r+1)*c)` of the flattened whole,
  `c = ceil(numel / N)` (empty ranges are not stored);
* replicated tensors: rank 0, whole;
* RankLocal subtrees: new rank r gets saved rank r's (ranks beyond the saved world get
  none, an index without RankLocal subtrees, and keep their template's values on restore;
  saved ranks beyond N are dropped).

Each rank file is streamed into a local temporary (bounded memory, see [Note: bounded
memory] in `ctl/stream.py`), checksummed while written, and published; the manifest is
written last, exclusively, which commits the step at the destination.

[Note: a reshard holds the destination's lease] The destination is a checkpoint root like
any other: one writer at a time (`_store/lease.py`). `write_resharded` takes its lease as a
holder of its own (run id `ckptctl-reshard`, this host and pid) before it touches the step
folder, keeps it refreshed while it writes, fences the manifest write with it, and releases
it at the end, whatever happened. Taking it follows the manager's rule: a released lease or
a provably dead holder is taken at once; a holder that refreshes while we watch (a live run)
refuses the reshard with `LeaseHeldError` naming it (run id, host, pid); one that does not
refresh for its ttl is taken over. So a reshard never races a run's writer on the same root,
and a run started on the destination meanwhile is refused, naming the reshard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import torch

from ckpt_manager._format.checksum import SAVE_ALGORITHM, checksum
from ckpt_manager._format.layout import MANIFEST_NAME, shard_file_name, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.rank_index import RankReport
from ckpt_manager._format.shard_file import FileLayout, dtype_from_name, plan_layout
from ckpt_manager._format.tree import Flattened, LeafKind, TensorLeaf
from ckpt_manager._save.commit import build_top_manifest
from ckpt_manager._save.plan import piece_records
from ckpt_manager._save.report import prepare_rank, written_report
from ckpt_manager._store.indexes import write_finished_index
from ckpt_manager._store.lease import Lease, describe_holder, holder_is_provably_dead, read_lease
from ckpt_manager._store.publish import CommitResult, publish_manifest
from ckpt_manager._store.steps import remove_uncommitted_step
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.render import Progress
from ckpt_manager.ctl.stream import TensorSource, stream_range, tensor_bytes
from ckpt_manager.errors import CheckpointError, ObjectExistsError

__all__ = [
    "RESHARD_LEASE_TTL_S",
    "RESHARD_RUN_ID",
    "ReshardPlan",
    "destination_lease",
    "plan_reshard",
    "write_resharded",
]

RESHARD_RUN_ID = "ckptctl-reshard"
"""The run id a reshard's lease records ([Note: a reshard holds the destination's lease])."""
RESHARD_LEASE_TTL_S = 120.0
"""The reshard's lease lifetime without refresh: the manager's default `lease_ttl_s`."""


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
    layout: FileLayout,
    out: BinaryIO,
    chunk_bytes: int,
    progress: Progress,
) -> tuple[int, int]:
    """Stream one new rank's shard file into `out`; returns its size and checksum (by
    `checksum.SAVE_ALGORITHM`, what its index names)."""
    crc = checksum(SAVE_ALGORITHM, layout.header)
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
                crc = checksum(SAVE_ALGORITHM, b"\x00" * gap, crc)
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
                crc = checksum(SAVE_ALGORITHM, data, crc)
                written += len(data)
                progress.advance(len(data))
    assert written == layout.total_bytes, (written, layout.total_bytes)
    return written, crc


@contextlib.contextmanager
def destination_lease(
    dest: Storage,
    *,
    ttl_s: float = RESHARD_LEASE_TTL_S,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[Lease]:
    """Hold the destination root's lease for the block ([Note: a reshard holds the
    destination's lease]); released at the end, whatever happened.

    Args:
        dest: the destination root.
        ttl_s: this holder's lease lifetime without refresh.
        on_wait: told (one line) when another holder's lease must be watched first.

    Raises:
        LeaseHeldError: a live run holds the root (the message names it).
        StorageError: the lease cannot be read or written.
    """
    held = read_lease(dest)
    if held is not None and not holder_is_provably_dead(held) and on_wait is not None:
        wait_s = max(ttl_s, float(held.get("ttl_s") or 0.0))
        on_wait(
            f"{dest.root_uri} is held by {describe_holder(held)}; watching its lease for up "
            f"to {wait_s:.0f} s (a live run refreshes it: refused; an expired one is taken over)"
        )
    lease = Lease(dest, RESHARD_RUN_ID, ttl_s)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()


def write_resharded(
    source: Storage,
    m: Manifest,
    dest: Storage,
    plan: ReshardPlan,
    *,
    chunk_bytes: int,
    progress: Progress,
    on_lease_wait: Callable[[str], None] | None = None,
) -> Manifest:
    """Write the resharded step under `dest` and commit it, holding `dest`'s lease.

    Args:
        source: the source root.
        m: the source step's complete manifest.
        dest: the destination root.
        plan: `plan_reshard(m, N)`.
        chunk_bytes: read chunk (memory stays within a few of these).
        progress: told bytes and files as they are written.
        on_lease_wait: see `destination_lease`.

    Returns:
        The committed manifest.

    Raises:
        LeaseHeldError: a live run holds the destination (nothing is written).
        LeaseLostError: the lease was taken over while writing (nothing is committed).
        ObjectExistsError: the step is already committed at the destination.
        CheckpointError: a read or write failed (nothing is committed then).
    """
    with destination_lease(dest, on_wait=on_lease_wait) as lease:
        if dest.exists(f"{step_dir(m.step)}/{MANIFEST_NAME}"):
            raise _already_committed(dest, m.step)
        # A leftover of an interrupted earlier attempt is never committed: start clean.
        if not remove_uncommitted_step(dest, m.step):  # committed since the look above
            raise _already_committed(dest, m.step)
        reports = [
            _write_rank(source, m, dest, plan, r, chunk_bytes=chunk_bytes, progress=progress)
            for r in range(plan.world_size)
        ]
        manifest = build_top_manifest(
            step=m.step,
            run_id=m.run_id,
            created_unix_s=m.created_unix_s,
            committed_unix_s=time.time(),
            reports=reports,
        )
        outcome = publish_manifest(dest, manifest, fence=lease.confirm)
    if outcome.result is CommitResult.COMMITTED:
        return manifest
    if outcome.result is CommitResult.CONFLICT:
        raise _already_committed(dest, m.step) from outcome.conflict
    if outcome.conflict is not None:  # FENCED: the lease was taken over
        raise outcome.conflict
    raise CheckpointError(f"{dest.root_uri}: step {m.step} was not committed: {outcome.cause}")


def _write_rank(
    source: Storage,
    m: Manifest,
    dest: Storage,
    plan: ReshardPlan,
    rank: int,
    *,
    chunk_bytes: int,
    progress: Progress,
) -> RankReport:
    """New rank `rank`'s shard file and index, written as its writer would; its report."""
    parts = plan.parts[rank]
    leaves = [p.leaf for p in parts]
    name = shard_file_name(rank) if parts else None
    layout = plan_layout([(x.key, x.tensor.dtype, tuple(x.tensor.shape)) for x in leaves])
    contribution = prepare_rank(
        step=m.step,
        rank=rank,
        flat=Flattened(m.tree, plan.rank_local_trees[rank], leaves),
        records=piece_records(leaves, layout, name),
        file_name=name,
        metrics=m.metrics,
    )
    size = crc = 0
    if name is not None:
        fd, tmp = tempfile.mkstemp(prefix=f"ckptctl-rank{rank}-", dir=_tmp_dir(dest))
        try:
            with os.fdopen(fd, "wb") as out:
                size, crc = _write_file(source, m, parts, layout, out, chunk_bytes, progress)
            dest.put_file(tmp, f"{step_dir(m.step)}/{name}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    index = write_finished_index(dest, contribution["index_json"], size, crc)
    progress.advance(num_files=1)
    return written_report(contribution, size=size, checksum=crc, index=index)


def _already_committed(dest: Storage, step: int) -> ObjectExistsError:
    return ObjectExistsError(
        errno.EEXIST, f"{dest.root_uri}: step {step} is already committed there"
    )


def _tmp_dir(dest: Storage) -> str | None:
    """Temporaries beside a local destination (same disk), else the system temp folder."""
    if dest.capabilities.local_paths:
        os.makedirs(dest.path(), exist_ok=True)
        return dest.path()
    return None
