"""One rank's save through the save path's own building blocks, without a process group.

What a rank's trainer and writer do for a save, in one process: flatten the state, pick the
leaves it writes, plan its shard file, build its pending index and report (`prepare_rank`),
write the file (`write_shard`) and its index (`write_finished_index`), and return the report
the coordinator's `commit_step` takes. Used by tests that simulate many ranks in one process
(the committed fixture's current-format twin, the 64-rank commit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt_manager._format.checksum import SAVE_ALGORITHM, checksum
from ckpt_manager._format.layout import shard_file_name, step_dir
from ckpt_manager._format.rank_index import RankReport
from ckpt_manager._format.shard_file import plan_layout
from ckpt_manager._format.tree import flatten
from ckpt_manager._save.plan import leaves_to_write, piece_records
from ckpt_manager._save.report import prepare_rank, written_report
from ckpt_manager._save.writer import write_shard
from ckpt_manager._store.indexes import write_finished_index
from ckpt_manager._store.storage import Storage


def save_rank_state(
    storage: Storage,
    *,
    step: int,
    rank: int,
    state: Any,
    metrics: Mapping[str, Any],
    spread_prefixes: int = 0,
) -> RankReport:
    """Write rank `rank`'s shard file and index of `state` at `step`; returns its report."""
    flat = flatten(state)
    leaves = leaves_to_write(flat, rank)
    layout = plan_layout([(x.key, x.tensor.dtype, tuple(x.tensor.shape)) for x in leaves])
    name = shard_file_name(rank, spread_prefixes) if leaves else None
    contribution = prepare_rank(
        step=step,
        rank=rank,
        flat=flat,
        records=piece_records(leaves, layout, name),
        file_name=name,
        metrics=metrics,
        spread_prefixes=spread_prefixes,
    )
    size = crc = 0
    if name is not None:
        data = bytearray(layout.total_bytes)
        data[: len(layout.header)] = layout.header
        for slot, leaf in zip(layout.slots, leaves, strict=True):
            raw = leaf.tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            data[slot.offset : slot.offset + slot.nbytes] = raw
        crc = checksum(SAVE_ALGORITHM, memoryview(data))  # the staging copy's, in a save
        size = write_shard(
            storage,
            f"{step_dir(step)}/{name}",
            memoryview(data),
            chunk_bytes=1 << 20,
            concurrency=1,
        )
    index = write_finished_index(
        storage, contribution["index_json"], size, crc, spread_prefixes=spread_prefixes
    )
    return written_report(contribution, size=size, checksum=crc, index=index)
