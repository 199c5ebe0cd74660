"""Export a step as a standard torch DCP checkpoint directory (`ckptctl restore --format dcp`).

The selection is read whole (consolidated, through `_load/regions.py`) and written with
DCP's own `FileSystemWriter` by `dcp.save` in this one process, so the output is exactly
what DCP itself writes: any `dcp.load` (at any world size, into plain tensors or DTensors)
reads it without trainingd installed. Memory holds the selected tensors once (use `--only`
to export part of a large state). Plain values are saved as DCP bytes entries; RankLocal
subtrees are left out, as in the other consolidated formats.

The saved state is turned into the layout plain torch code loads (`build`): a model's tied
names (`__aliases__`) become keys holding their target's tensor, as `dcp.save` of the plain
module's `state_dict()` stores them, so the model entry has exactly `module.state_dict()`'s
keys; an optimizer's state (`{"state": {name: ...}, "param_groups": [{..., "param_names"}]}`,
CONTRACTS.md) keeps its per-name state and names each group's parameters under `"params"`,
which is torch's `get_optimizer_state_dict` layout (`set_optimizer_state_dict` takes it).
"""

from __future__ import annotations

import warnings
from typing import Any

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._load.regions import StepRegions
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import GROUP_NAMES_KEY
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.export import Selection, tensors_of, with_aliases
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
            return _torch_optimizer_layout(with_aliases({str(k): build(v) for k, v in body}))
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


def _torch_optimizer_layout(d: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state of ours in `get_optimizer_state_dict`'s layout; other dicts as given.

    Ours names each group's parameters under `GROUP_NAMES_KEY`; torch's under `"params"`. The
    per-parameter `"state"` is keyed by name in both (a tied parameter by its first name,
    which is the one `named_parameters()` yields).
    """
    groups = d.get("param_groups")
    if not isinstance(d.get("state"), dict) or not isinstance(groups, list):
        return d
    if not all(isinstance(g, dict) and GROUP_NAMES_KEY in g for g in groups):
        return d
    renamed = [
        {("params" if k == GROUP_NAMES_KEY else k): v for k, v in g.items() if k != "params"}
        for g in groups
    ]
    return {**d, "param_groups": renamed}
