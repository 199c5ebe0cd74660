"""Pinned steps, stored in the root (`_pins/step-<N>`) so the manager and `ckptctl` agree.

A pin is an empty object; pinning is idempotent and never read-modify-write, so two writers
cannot lose each other's pins.
"""

from __future__ import annotations

from ckpt_manager._store.manifest import PINS_DIR, parse_step_dir, step_dir
from ckpt_manager._store.storage import Storage

__all__ = ["pin_step", "pinned_steps", "unpin_step"]


def pinned_steps(storage: Storage) -> set[int]:
    """Steps pinned under the root."""
    steps = (parse_step_dir(n) for n in storage.list_names(PINS_DIR))
    return {s for s in steps if s is not None}


def pin_step(storage: Storage, step: int) -> None:
    """Pin a step: retention never deletes it."""
    storage.write(f"{PINS_DIR}/{step_dir(step)}", b"")


def unpin_step(storage: Storage, step: int) -> None:
    """Remove a pin (a missing pin is fine)."""
    storage.remove(f"{PINS_DIR}/{step_dir(step)}")
