"""The kept step: a step the process owning the tier's directory asks every rank to keep.

[Note: a node keeps the step its peer's replica holds] After a node loss, the ranks of the
replacement node restore from the replicas their peer holds, the other ranks from their own
slots, and the restore agreement needs one step held by all of them. A rank's two slots move
on every snapshot while a replica lands a little later (it is sent once the snapshot is
complete): with `memory_every 1`, a replica one step late is already older than both slots of
the other ranks, and the restore falls back to the durable tier. So the daemon that holds a
replica of another node's ranks names its step here (the newest step every such rank's replica
holds complete), and this node's ranks never overwrite their slot of that step (`MemoryTier.choose`
treats it as pinned, as a durable write in flight pins one): the newest step and the kept step
stay, and a snapshot that finds both primary slots so held takes an extra slot. When none is
left (a durable write pins the extra one, or the tmpfs has no room for it), the kept step
yields and the snapshot overwrites it: a skipped snapshot would cost more than the kept step
saves (skips differ between nodes, so the ranks' steps drift apart).
On a ring of two nodes this makes a node loss restorable from memory at the kept step; on a
longer ring it holds for the lost node's successor (the other nodes keep their own
predecessor's step, usually the same one).

    <directory>/kept-step.json     {"run_id": ..., "step": N}

Written atomically by the daemon; read by the ranks' training threads (cached by the file's
version: one `stat` per snapshot while it does not change). Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os

__all__ = ["KEPT_STEP_FILE", "KeptStep", "write_kept_step"]

KEPT_STEP_FILE = "kept-step.json"
"""The kept step's file in the tier's directory."""


def write_kept_step(directory: str, run_id: str, step: int) -> None:
    """Ask the ranks of `run_id` using `directory` to keep their snapshot of `step`
    (atomic replace).

    Raises:
        OSError: the file could not be written.
    """
    path = os.path.join(directory, KEPT_STEP_FILE)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as f:
        json.dump({"run_id": run_id, "step": int(step)}, f)
    os.replace(temp, path)


class KeptStep:
    """One rank's reader of the kept step (training thread).

    Args:
        directory: the tier's directory.
        run_id: this run (a file of another run is ignored).
    """

    def __init__(self, directory: str, run_id: str) -> None:
        self._path = os.path.join(directory, KEPT_STEP_FILE)
        self._run_id = run_id
        self._version: tuple[int, int, int] | None = None
        self._step: int | None = None

    def step(self) -> int | None:
        """The step to keep (None: none asked, or the file does not read)."""
        try:
            st = os.stat(self._path)
        except OSError:
            self._version, self._step = None, None
            return None
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        if version != self._version:
            self._version, self._step = version, None
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(self._path, encoding="utf-8") as f:
                    raw = json.load(f)
                if isinstance(raw, dict) and raw.get("run_id") == self._run_id:
                    self._step = int(raw["step"])
        return self._step
