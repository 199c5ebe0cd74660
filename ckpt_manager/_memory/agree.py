"""The restore agreement: the newest step every rank holds complete and verified in memory.

Each rank lists its slots' metas, keeps those of this run, this world size and (with a
template) this layout, verifies the newest payload's checksum (reading memory, not storage;
the next newest if it fails, and so on), and offers that step and the older ones; one
all-gather on the manager's gloo group exchanges every rank's
offer (steps with their shared-layout fingerprint, the reasons it refused the others). The
newest step that every rank offers with the same fingerprint wins. Otherwise the restore falls
back to the durable tier with one reason, the same on every rank, e.g.
`first start: no rank holds a memory snapshot`, `rank 1 holds no verified memory step
(slot 0: checksum mismatch ...)`, `rank 0: world size 3 at snapshot, 2 now`.

[Note: the chosen slot is verified once] Verifying every slot before the exchange read the
older slot's whole payload too (as large as the rank's state) although the newest step is
the one restored whenever every rank holds it: 0.04 s more per 256 MiB here, on the
restart's critical path. An older slot is offered unverified and checked only if the
agreement picks it (`restore.py`); one that fails then sends every rank to the durable tier
through the loads' exchange, as a refused slot did before (it left no common step either:
a rank holds two slots, and the newest was not common). The newest verified slot stays
mapped from its check to its load (`map_verified`): its pages are mapped once.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable
from typing import Any, NamedTuple

from ckpt_manager._coord import Coordinator
from ckpt_manager._memory.load import map_verified, needs_template
from ckpt_manager._memory.meta import SlotMeta
from ckpt_manager._memory.slots import SlotFiles

__all__ = ["Candidate", "Offer", "agree", "local_offer", "release"]


class Candidate(NamedTuple):
    """A slot this rank can restore."""

    slot: int
    """Slot index."""
    meta: SlotMeta
    """Its meta."""
    mapped: mmap.mmap | None = None
    """Its payload, mapped and verified (None: not verified yet; verify before loading)."""


class Offer(NamedTuple):
    """What a rank tells the others (small and picklable)."""

    steps: dict[int, str]
    """Verified steps, each with its snapshot's shared-layout fingerprint."""
    reasons: list[str]
    """Why each other slot was refused."""
    num_slots: int
    """Slots with a meta (0: this rank has never snapshotted, e.g. a first start)."""
    floor: int = -1
    """The newest step this rank knows the run holds durably (-1: none); memory steps below
    the newest floor of any rank are stale ([Note: a memory step older than a durable one is
    stale] in `floor.py`)."""


def local_offer(
    files: SlotFiles,
    *,
    run_id: str,
    world_size: int,
    template_layout: str | None,
    with_template: bool,
    floor: int | None = None,
) -> tuple[Offer, dict[int, Candidate]]:
    """This rank's offer and its candidates by step.

    Args:
        files: this rank's slot files.
        run_id: the run's id (a slot of another run is refused).
        world_size: the world size now (a snapshot of another is refused).
        template_layout: the template's layout fingerprint (None: no template).
        with_template: a template was given (without one, sharded pieces cannot be returned
            whole).
        floor: the newest step this rank knows the run holds durably (None: none).
    """
    reasons: list[str] = []
    candidates: dict[int, Candidate] = {}
    raw = files.read_metas()
    parsed: list[tuple[int, SlotMeta]] = []
    for slot, found in sorted(raw.items()):
        if isinstance(found, str):
            reasons.append(f"slot {slot}: {found}")
            continue
        try:
            parsed.append((slot, SlotMeta.parse(found)))
        except ValueError as err:
            reasons.append(f"slot {slot}: {err}")
    try:
        # Newest first: the first that verifies is kept mapped, older ones are offered
        # unverified ([Note: the chosen slot is verified once]).
        verified = False
        for slot, meta in sorted(parsed, key=lambda p: p[1].step, reverse=True):
            refused = _refusal(meta, files.rank, run_id, world_size, template_layout, with_template)
            mapped = None
            if refused is None and not verified:
                mapped, refused = map_verified(files.payload_path(slot), meta)
            if refused is not None:
                reasons.append(f"slot {slot} (step {meta.step}): {refused}")
                continue
            if meta.step in candidates:  # two slots of one step hold the same bytes
                if mapped is not None:
                    mapped.close()
                continue
            candidates[meta.step] = Candidate(slot, meta, mapped)
            verified = verified or mapped is not None
    except BaseException:
        release(candidates.values())
        raise
    steps = {step: c.meta.global_layout for step, c in candidates.items()}
    offer = Offer(steps, reasons, len(raw), -1 if floor is None else floor)
    return offer, candidates


def release(candidates: Iterable[Candidate]) -> None:
    """Close the candidates' kept mappings."""
    for candidate in candidates:
        if candidate.mapped is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
                candidate.mapped.close()


def _refusal(
    meta: SlotMeta,
    rank: int,
    run_id: str,
    world_size: int,
    template_layout: str | None,
    with_template: bool,
) -> str | None:
    if meta.run_id != run_id:
        return f"a snapshot of run {meta.run_id!r}, not of this run {run_id!r}"
    if meta.rank != rank:
        return f"a snapshot of rank {meta.rank}"
    if meta.world_size != world_size:
        return f"world size {meta.world_size} at snapshot, {world_size} now"
    if template_layout is not None and meta.layout != template_layout:
        return "the template's layout (keys, dtypes, shapes, placements) differs"
    if not with_template and needs_template(meta):
        return "holds sharded pieces: a restore without a template returns whole tensors"
    return None


def agree(coord: Coordinator, offer: Offer) -> tuple[int | None, str | None]:
    """Exchange offers (one all-gather); returns `(step, None)` or `(None, reason)`, the
    same on every rank."""
    offers: list[Any] = coord.all_gather(tuple(offer))
    gathered = [Offer(*o) for o in offers]
    common = set(gathered[0].steps)
    for other in gathered[1:]:
        common &= set(other.steps)
    agreed = [s for s in common if len({o.steps[s] for o in gathered}) == 1]
    floor = max(o.floor for o in gathered)
    if agreed and max(agreed) >= floor:
        return max(agreed), None
    if agreed:
        return None, (
            f"the newest step every rank holds in memory ({max(agreed)}) is older than step "
            f"{floor}, which the run holds durably"
        )
    return None, _reason(gathered, common)


def _reason(offers: list[Offer], common: set[int]) -> str:
    if all(o.num_slots == 0 for o in offers):
        return "first start: no rank holds a memory snapshot"
    if common:
        return f"ranks hold steps {sorted(common)} with different layouts"
    for rank, offer in enumerate(offers):
        if not offer.steps:
            detail = "; ".join(offer.reasons) if offer.reasons else "no snapshot"
            return f"rank {rank} holds no verified memory step ({detail})"
    held = "; ".join(f"rank {r}: {sorted(o.steps)}" for r, o in enumerate(offers))
    return f"no step is held by every rank ({held})"
