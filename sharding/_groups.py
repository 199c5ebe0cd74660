"""Optimizer parameter groups: torch-style groups resolved to element ranges of the buckets.

A rank's shard of a bucket is a flat range that may span parameters of several groups, so a
group is not a set of tensors the engine can hand to the torch optimizer: it is a set of
element ranges. `group_runs` maps each bucket's local main-weight range to runs of one
group; `DistributedOptimizer` cuts the runs into chunks, and each torch parameter group of
the inner optimizer holds the chunks of one user group. Alignment and padding gaps join the
group of the parameter before them (or after, at the start): they hold zeros and get zero
gradients, so any elementwise update leaves them at zero whatever the hyperparameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from sharding._buffer import FlatBucket

__all__ = ["group_runs", "no_decay_groups", "resolve_groups"]


def no_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The usual two groups: decay matrices; no decay on biases, norm weights, embeddings.

    Works on a plain module (for `torch.optim.AdamW(groups, ...)`) and on a
    `FullyShardedDataParallel` wrapper (for `model.make_optimizer(AdamW, groups, ...)`).
    A parameter goes without decay if it has fewer than two dimensions (biases, LayerNorm /
    RMSNorm weights) or belongs to an `nn.Embedding` (a weight tied to an embedding, such
    as a tied LM head, counts as an embedding). Only parameters that require grad are listed.

    Args:
        model: the module or wrapper.
        weight_decay: the decay of the first group.

    Returns:
        `[{"params": [...], "weight_decay": weight_decay}, {"params": [...],
        "weight_decay": 0.0}]`, parameters in `model.parameters()` order.
    """
    no_decay: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding) or len(param.shape) < 2:
                no_decay.add(id(param))
    trained = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trained if id(p) not in no_decay], "weight_decay": weight_decay},
        {"params": [p for p in trained if id(p) in no_decay], "weight_decay": 0.0},
    ]


def resolve_groups(
    buckets: Sequence[FlatBucket], param_groups: Iterable[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]], dict[tuple[int, int], int]]:
    """Check the user's groups and say which group each trained parameter belongs to.

    Args:
        buckets: the trained buckets, in optimizer order.
        param_groups: torch-style groups whose `"params"` hold the wrapped module's
            parameters or their names (as in `model.module.named_parameters()`); `None`
            means one group of every trained parameter.

    Returns:
        `(hyperparameters per group, {(bucket position, slot index): group index})`.

    Raises:
        ValueError: a parameter is unknown, listed twice, or a trained one is missing.
    """
    by_id: dict[int, tuple[int, int]] = {}
    by_name: dict[str, tuple[int, int]] = {}
    for pos, bucket in enumerate(buckets):
        for index, (slot, param) in enumerate(zip(bucket.layout.slots, bucket.params, strict=True)):
            by_id[id(param)] = (pos, index)
            for name in slot.names:
                by_name[name] = (pos, index)
    if param_groups is None:
        return [{}], dict.fromkeys(by_id.values(), 0)
    groups: list[dict[str, Any]] = []
    owner: dict[tuple[int, int], int] = {}
    for g, group in enumerate(param_groups):
        if "params" not in group:
            raise ValueError(f"parameter group {g} has no 'params'; give a list of parameters")
        members = group["params"]
        if isinstance(members, str | nn.Parameter):
            members = [members]
        for member in members:
            key = by_name.get(member) if isinstance(member, str) else by_id.get(id(member))
            if key is None:
                if not isinstance(member, str) and not getattr(member, "requires_grad", True):
                    continue  # frozen parameters have no optimizer state, as in torch
                what = repr(member) if isinstance(member, str) else "a tensor"
                raise ValueError(
                    f"parameter group {g} lists {what} that is not a trained parameter of the "
                    "wrapped module; list the wrapper's parameters (after wrapping) or their "
                    "names from model.module.named_parameters()"
                )
            if key in owner:
                name = buckets[key[0]].layout.slots[key[1]].names[0]
                raise ValueError(f"parameter {name!r} is in groups {owner[key]} and {g}")
            owner[key] = g
        groups.append({k: v for k, v in group.items() if k != "params"})
    missing = [
        buckets[p].layout.slots[i].names[0] for p, i in by_id.values() if (p, i) not in owner
    ]
    if missing:
        raise ValueError(
            f"trained parameters {missing[:5]} are in no parameter group; the engine steps every "
            "trained parameter, so list each in one group (freeze it with requires_grad=False "
            "before wrapping to leave it out)"
        )
    return groups, owner


def group_runs(
    bucket: FlatBucket, pos: int, owner: Mapping[tuple[int, int], int]
) -> list[tuple[int, int, int]]:
    """`(start, end, group)` runs tiling the bucket's main weights, in local coordinates."""
    layout = bucket.layout
    numel = bucket.main_weight.numel()
    lo = bucket.start if numel != layout.padded_numel else 0
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(layout.slots):
        begin = 0 if index == 0 else slot.offset
        end = (
            layout.slots[index + 1].offset if index + 1 < len(layout.slots) else layout.padded_numel
        )
        a, e = max(begin, lo) - lo, min(end, lo + numel) - lo
        if a >= e:
            continue
        group = owner[(pos, index)]
        if runs and runs[-1][2] == group and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], e, group)
        else:
            runs.append((a, e, group))
    return runs
