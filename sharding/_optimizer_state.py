"""A distributed optimizer's state made without a step, for a restore to fill in place.

[Note: optimizer state made for a restore] A restore fills the leaves of a template state dict
in place, and a torch optimizer creates its state lazily at its first step: a template taken
before any step has no optimizer state to fill. The daemon used to run one torch step on
zero gradients at learning rate 0, which for a rank of 256 MiB of state cost 0.2 s of
zero gradients and 0.17 s of a full AdamW update, left the state in one tensor per chunk (so
`sharded_state_dict` concatenated, 0.09 s, the pieces spanning chunks into copies), and the
load then copied the restored copies into new flat tensors (0.09 s): three passes over the
state and a second allocation of it on the restart's critical path, on top of the restore's
one copy (a profile of one rank's memory restore, `bench/recovery_timeline.py --job big` for
the restart around it).

`materialize_state` learns each parameter group's state entries from one step of the same
optimizer class on a two-element probe (the chunks' dtype and device, the group's
hyperparameters, a zero gradient), then gives every chunk the same entries: elementwise ones
(tensors shaped like the probe) as views of one tensor per key per bucket, the layout
`_make_state_adjacent` gives after a step, filled with the probe's value (what a zero step
leaves, for AdamW zeros: an entry a restore does not cover reads as a fresh state's, never as
uninitialized memory); scalar ones (Adam's `step`) and plain values as the probe's, one copy
per chunk (torch updates a scalar in place). The pieces `sharded_state_dict` serves are then
views of the live state, the restore writes straight into it, and the load recognises its own
pieces (`_restored_in_place` in `_optimizer.py`) and keeps the state where it is.

An optimizer whose probe cannot be built or stepped, or whose state is not elementwise (a
tensor entry shaped otherwise), gets the zero step instead (`_zero_step`): the same state a
training step makes, at the old cost.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from sharding.errors import ShardingError

__all__ = ["check_uniform_entries", "materialize_state"]

_PROBE_NUMEL = 2
"""Elements of the probe parameter: a per-element entry has this shape, a scalar has none."""


def materialize_state(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    chunks: Sequence[tuple[int, int, int, int]],
) -> bool:
    """Give every chunk of a distributed optimizer the state a training step would, without a
    step; the caller then records the layout (`_make_state_adjacent`).

    Args:
        optimizer: the torch optimizer over the chunks.
        params: the chunk tensors (its parameters), in chunk order.
        chunks: `(bucket position, start, end, group)` of each chunk, in bucket order (main
            weight coordinates).

    Returns:
        True if it made the state; False if every chunk had state already (a step, a load,
        or an optimizer that makes its state when built, as Adagrad does): nothing changed.

    Raises:
        ShardingError: some chunks have state and others not (not a state a step leaves).
    """
    held = [bool(optimizer.state.get(p)) for p in params]
    if all(held):
        return False
    if any(held):
        raise ShardingError(
            f"materialize_state(): {sum(held)} of the optimizer's {len(held)} chunks have "
            "state and the others none; clear it (optimizer.optimizer.state.clear()) first"
        )
    probes = [_probe(optimizer, g) for g in range(len(optimizer.param_groups))]
    if any(p is None for p in probes):
        _zero_step(optimizer, params)
        return True
    entries = [p for p in probes if p is not None]
    by_bucket: dict[int, list[tuple[tuple[int, int, int, int], torch.Tensor]]] = {}
    for chunk, param in zip(chunks, params, strict=True):
        by_bucket.setdefault(chunk[0], []).append((chunk, param))
    for members in by_bucket.values():
        shared = _same_entries([entries[g] for g in {chunk[3] for chunk, _ in members}])
        flats: dict[str, torch.Tensor] = {}
        base, end = members[0][0][1], members[-1][0][2]
        for chunk, param in members:
            state: dict[str, Any] = {}
            for key, value in entries[chunk[3]].items():
                if _is_per_element(value):
                    if shared:
                        flat = flats.get(key)
                        if flat is None:
                            flat = flats[key] = _filled(end - base, value, param)
                        state[key] = flat[chunk[1] - base : chunk[2] - base].view_as(param)
                    else:
                        state[key] = _filled(param.numel(), value, param).view_as(param)
                elif isinstance(value, torch.Tensor):
                    state[key] = value.clone()
                else:
                    state[key] = copy.deepcopy(value)
            optimizer.state[param] = state
    return True


def check_uniform_entries(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> None:
    """Refuse parameter groups whose optimizer state has different per-element entries.

    [Note: one set of state entries per optimizer] A bucket's state dict and its load take
    the entries of the bucket's first chunk for every parameter in it, and chunks of several
    groups share a bucket: with AdamW's `amsgrad` in some groups only, the amsgrad groups'
    `max_exp_avg_sq` was silently left out of every checkpoint, and a resumed run had none
    (torch then fails at the first step). Each group's entries come from a probe step
    (`_probe`); a group the probe cannot step is not judged.

    Args:
        optimizer: the torch optimizer over the chunks.
        names: a label per group (its first parameter's name), for the message.

    Raises:
        ShardingError: two groups have different per-element entries.
    """
    seen: dict[tuple[str, ...], int] = {}
    for index in range(len(optimizer.param_groups)):
        probe = _probe(optimizer, index)
        if probe is None or not optimizer.param_groups[index]["params"]:
            continue
        entries = tuple(sorted(k for k, v in probe.items() if _is_per_element(v)))
        seen.setdefault(entries, index)
    if len(seen) > 1:
        found = "; ".join(
            f"group {g} ({names[g] if g < len(names) else '?'}...): {list(e) or 'none'}"
            for e, g in seen.items()
        )
        raise ShardingError(
            "parameter groups keep different per-element optimizer state "
            f"({found}); give every group the same state options (e.g. amsgrad)"
        )


def _probe(optimizer: torch.optim.Optimizer, index: int) -> dict[str, Any] | None:
    """The state one zero-gradient step of `optimizer`'s class gives a probe in group `index`
    (None: no probe could be built or stepped, or its state is not elementwise)."""
    group = optimizer.param_groups[index]
    params = group["params"]
    if not params:
        return {}
    sample = params[0]
    probe = torch.zeros(_PROBE_NUMEL, dtype=sample.dtype, device=sample.device)
    hyper = {k: v for k, v in group.items() if k != "params"}
    cls: Any = type(optimizer)  # a subclass: its own constructor, defaults included
    try:
        probe_opt = cls([{**hyper, "params": [probe]}])
        probe.grad = torch.zeros_like(probe)
        with torch.no_grad():
            probe_opt.step()
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None  # the zero step decides ([Note: optimizer state made for a restore])
    state = dict(probe_opt.state.get(probe, {}))
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not _is_per_element(value):
            return None
    return state


def _is_per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (_PROBE_NUMEL,)


def _same_entries(states: list[dict[str, Any]]) -> bool:
    """Whether the groups of one bucket give the same per-element entries (then one tensor per
    key spans the bucket's chunks)."""
    first = states[0]
    keys = {k: v.dtype for k, v in first.items() if _is_per_element(v)}
    return all({k: v.dtype for k, v in s.items() if _is_per_element(v)} == keys for s in states[1:])


def _filled(numel: int, probe_value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    out = torch.empty(numel, dtype=probe_value.dtype, device=param.device)
    out.fill_(probe_value[0])
    return out


def _zero_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """One step of the torch optimizer on zero gradients at learning rate 0: every chunk's
    state as a training step makes it, no weight moved (AdamW's decay is `1 - lr x wd`, its
    update `-0 x ...`)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        for param in params:
            param.grad = torch.zeros_like(param)
        with torch.no_grad():
            optimizer.step()
    finally:
        for param in params:
            param.grad = None
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
