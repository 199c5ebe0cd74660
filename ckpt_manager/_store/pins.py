"""Pinned steps, stored in the root (`_pins/step-<N>`) so the manager and `ckptctl` agree.

A pin is an empty object; pinning is idempotent and never read-modify-write, so two writers
cannot lose each other's pins. A pin is confirmed only once the step's manifest is seen after
the pin was written (`pin_committed_step`); deletions check for pins on both sides of removing
the manifest (see [Note: pins win races] in `catalog.delete_step`). Pinning and unpinning a
committed step also record it in the root catalog's entry (`root_catalog.set_pinned`, best
effort: the pin objects stay the truth).
"""

from __future__ import annotations

import time

from ckpt_manager._format.layout import MANIFEST_NAME, PINS_DIR, parse_step_dir, step_dir
from ckpt_manager._store.root_catalog import set_pinned
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import StepNotFoundError

__all__ = ["is_pinned", "pin_committed_step", "pin_step", "pinned_steps", "unpin_step"]

_CONFIRM_POLL_S = 0.05


def _pin_name(step: int) -> str:
    return f"{PINS_DIR}/{step_dir(step)}"


def pinned_steps(storage: Storage) -> set[int]:
    """Steps pinned under the root."""
    steps = (parse_step_dir(n) for n in storage.list_names(PINS_DIR))
    return {s for s in steps if s is not None}


def is_pinned(storage: Storage, step: int) -> bool:
    """Whether `step` is pinned now (one existence check, for the moment of a deletion)."""
    return storage.exists(_pin_name(step))


def pin_step(storage: Storage, step: int) -> None:
    """Write a pin for `step`, committed or not (retention never deletes a pinned step)."""
    storage.write(_pin_name(step), b"")


def pin_committed_step(storage: Storage, step: int, *, confirm_s: float = 2.0) -> None:
    """Pin a committed step, confirmed against a concurrent deletion.

    The pin is written first, then the step's manifest must be seen: a deletion that removed
    it meanwhile either puts it back on seeing the pin (waited for up to `confirm_s`) or had
    already finished, and then the pin is removed again and the call fails.

    Raises:
        StepNotFoundError: the step is not committed (or was deleted while being pinned).
    """
    pin_step(storage, step)
    manifest = f"{step_dir(step)}/{MANIFEST_NAME}"
    deadline = time.monotonic() + confirm_s
    while not storage.exists(manifest):
        if time.monotonic() >= deadline:
            storage.remove(_pin_name(step))
            raise StepNotFoundError(
                f"step {step} is not committed (retention may have deleted it while it was "
                "being pinned); no pin was left"
            )
        time.sleep(_CONFIRM_POLL_S)
    set_pinned(storage, step, True)  # the root catalog's copy; `_pins/` stays the truth


def unpin_step(storage: Storage, step: int) -> None:
    """Remove a pin (a missing pin is fine)."""
    storage.remove(_pin_name(step))
    set_pinned(storage, step, False)
