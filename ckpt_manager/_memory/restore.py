"""Restore from memory (collective): agree on a step, load it from the rank's own slot.

Two collectives on the manager's start-up group, nothing from storage: the agreement's
all-gather (`agree.py`) and, after each rank loaded its slot, an all-gather of the loads'
outcomes, so a rank whose load failed (a template that does not fit) sends every rank to the
durable tier together ([Note: every rank reaches the exchange] in `_load/recover.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import structlog

from ckpt_manager._coord import Coordinator
from ckpt_manager._format.tree import flatten
from ckpt_manager._memory.agree import Candidate, Offer, agree, local_offer, release
from ckpt_manager._memory.floor import read_floor
from ckpt_manager._memory.load import load_slot, map_verified
from ckpt_manager._memory.meta import ORIGIN_LOCAL, ORIGIN_REPLICA
from ckpt_manager._memory.plan import held_leaves, layout_fingerprints
from ckpt_manager._memory.tier import MemoryTier

__all__ = ["MemoryRestore", "restore_from_memory"]

_log = structlog.get_logger("ckpt_manager")


class MemoryRestore(NamedTuple):
    """The outcome of `restore_from_memory`: a step and its state, or why not."""

    step: int | None
    """The step restored (None: the memory tier could not serve it)."""
    state: Any
    """Its state (the template's structure when one was given)."""
    reason: str | None
    """Why memory was not used (None when it was)."""
    source: str = ORIGIN_LOCAL
    """`memory`, or `replica` when this rank's slot was copied from a peer node's replica."""


def _template_layout(template: Any) -> str:
    try:
        return layout_fingerprints(held_leaves(flatten(template)))[0]
    except (TypeError, ValueError) as err:  # no snapshot's layout: every slot is refused
        return f"unusable template: {err}"


def _load(tier: MemoryTier, chosen: Candidate, template: Any) -> Any:
    """Load the agreed slot, verifying it first if the offer did not ([Note: the chosen slot
    is verified once] in `agree.py`)."""
    path = tier.files.payload_path(chosen.slot)
    if chosen.mapped is not None:
        return load_slot(path, chosen.meta, template, mapped=chosen.mapped)
    mapped, refused = map_verified(path, chosen.meta)
    if mapped is None:
        raise ValueError(f"slot {chosen.slot} (step {chosen.meta.step}): {refused}")
    try:
        return load_slot(path, chosen.meta, template, mapped=mapped)
    finally:
        release([chosen._replace(mapped=mapped)])


def restore_from_memory(
    tier: MemoryTier, coord: Coordinator, template: Any, known_durable: int | None = None
) -> MemoryRestore:
    """Restore the newest step every rank holds in memory (collective).

    Args:
        tier: this rank's memory tier.
        coord: the manager's start-up group.
        template: the restore template with DTensors wrapped (`dtensor.wrap_dtensors`), or
            None.
        known_durable: the newest committed step this rank knows of otherwise (the
            coordinator's, from the root's catalog), or None.

    Raises:
        CheckpointError: a collective failed (a peer died).
    """
    log = _log.bind(rank=coord.rank)
    floors = [
        s for s in (known_durable, read_floor(tier.files.directory, tier.run_id)) if s is not None
    ]
    try:
        offer, candidates = local_offer(
            tier.files,
            run_id=tier.run_id,
            world_size=coord.world_size,
            template_layout=None if template is None else _template_layout(template),
            with_template=template is not None,
            floor=max(floors, default=None),
        )
    except Exception as err:  # [Note: every rank reaches the exchange]
        offer, candidates = Offer({}, [f"listing the slots failed: {err}"], 1), {}
    try:
        for refused in offer.reasons:
            log.warning("ckpt_memory_slot_refused", reason=refused)
        step, reason = agree(coord, offer)
        if step is None:
            return MemoryRestore(None, None, reason)
        chosen = candidates[step]
        state, error = None, None
        try:
            state = _load(tier, chosen, template)
        except Exception as err:  # [Note: every rank reaches the exchange]
            error = f"rank {coord.rank}: {type(err).__name__}: {err}"
    finally:
        release(candidates.values())
    errors = [e for e in coord.all_gather(error) if e]
    if errors:
        return MemoryRestore(None, None, f"memory step {step} did not load: {errors[0]}")
    source = ORIGIN_REPLICA if chosen.meta.origin == ORIGIN_REPLICA else ORIGIN_LOCAL
    return MemoryRestore(step, state, None, source)
