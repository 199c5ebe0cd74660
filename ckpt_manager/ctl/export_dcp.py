"""Export a step as a standard torch DCP checkpoint directory (`ckptctl restore --format dcp`).

The selection is read whole (consolidated, through `_load/regions.py`) and written with
DCP's own `FileSystemWriter` by `dcp.save` in this one process, so the output is exactly
what DCP itself writes: any `dcp.load` (at any world size, into plain tensors or DTensors)
reads it without trainingd installed. Memory holds the selected tensors once (use `--only`
to export part of a large state). Plain values are saved as DCP bytes entries; RankLocal
subtrees are left out, as in the other consolidated formats.
"""

from __future__ import annotations

import warnings
from typing import Any

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._load.regions import StepRegions
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.export import Selection, tensors_of
from ckpt_manager.ctl.render import Progress

__all__ = ["export_dcp"]


def export_dcp(
    storage: Storage, m: Manifest, sel: Selection, directory: str, *, progress: Progress
) -> int:
    """Write the selection as a DCP checkpoint under local `directory`; returns tensors written.

    The step's files must already be verified (the caller's `verify_files`); sizes are
    checked again as they are read.

    Raises:
        UsageError: the selection is not a dict (DCP state dicts are).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    if sel.tree[0] != "d":
        raise UsageError(
            f"--format dcp needs a dict at the top of the exported state; step {m.step} "
            "has none (select one with --only)"
        )
    regions = StepRegions(storage, m.step, verify_checksums=False, on_read=progress.advance)

    def build(node: Any) -> Any:
        tag, body = node[0], node[1]
        if tag == "v":
            return body
        if tag == "d":
            return {str(k): build(v) for k, v in body}
        if tag in ("l", "t"):
            items = [build(v) for v in body]
            return tuple(items) if tag == "t" else items
        return regions.whole(body)

    state = build(sel.tree)
    with warnings.catch_warnings():
        # dcp.save without a process group says it assumes one process: that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(state, storage_writer=FileSystemWriter(directory), no_dist=True)
    return len(tensors_of(sel.tree))
