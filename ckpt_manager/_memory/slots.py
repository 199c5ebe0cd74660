"""One rank's slot files in the memory tier's directory: payloads, metas, allocation.

    <directory>/rank-<r:05d>.slot-<k>          payload: the snapshot's bytes
    <directory>/rank-<r:05d>.slot-<k>.json     meta: what the payload holds (`_memory/meta.py`)

A payload file is allocated to its full size with `posix_fallocate` before anything is mapped
or copied, so a tmpfs without room fails there with ENOSPC (a `CheckpointError` naming the
directory and the size), never later with a SIGBUS on a page the mapping could not get. A
file only grows (re-allocated when the state grows) and is reused across snapshots.

A meta is written atomically (temp name, fsync, rename) once its payload is complete, and
removed before the payload is overwritten: a slot without a meta holds nothing. The files
outlive the process that wrote them (that is the point); the caller owns the directory and
removes it when the run ends.

Torch-free: the restore agreement lists and reads metas without it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from typing import Any

from ckpt_manager.errors import CheckpointError

__all__ = ["MIN_SLOT_BYTES", "SlotFiles"]

MIN_SLOT_BYTES = 1 << 16
"""Smallest payload file (as the smallest staging buffer)."""

_META_SUFFIX = ".json"


class SlotFiles:
    """The slot files of one rank in one directory."""

    def __init__(self, directory: str, rank: int) -> None:
        """Use `directory` (which must exist) for `rank`'s slots.

        Raises:
            ValueError: `directory` is not an existing directory.
        """
        if not os.path.isdir(directory):
            raise ValueError(
                f"memory tier directory {directory!r} does not exist: the caller creates it "
                "(on a tmpfs such as /dev/shm) before the checkpoint manager starts"
            )
        self.directory = directory
        """The tier's directory."""
        self.rank = rank
        """Whose slots these are."""
        self._prefix = f"rank-{rank:05d}.slot-"
        self._pattern = re.compile(re.escape(self._prefix) + r"(\d+)" + re.escape(_META_SUFFIX))

    @staticmethod
    def ranks_in(directory: str) -> list[int]:
        """Every rank with a slot file (payload or meta) in `directory`, ascending."""
        ranks = set()
        for name in _listdir(directory):
            head, dot, _ = name.partition(".slot-")
            if dot and head.startswith("rank-") and head[5:].isdigit():
                ranks.add(int(head[5:]))
        return sorted(ranks)

    def payload_path(self, slot: int) -> str:
        """The payload file of `slot`."""
        return os.path.join(self.directory, f"{self._prefix}{slot}")

    def meta_path(self, slot: int) -> str:
        """The meta file of `slot`."""
        return self.payload_path(slot) + _META_SUFFIX

    def payload_size(self, slot: int) -> int:
        """The payload file's size in bytes (0 when it does not exist)."""
        try:
            return os.stat(self.payload_path(slot)).st_size
        except FileNotFoundError:
            return 0

    def existing_slots(self) -> list[int]:
        """Slots with a payload file, ascending."""
        found = []
        prefix = self._prefix
        for name in _listdir(self.directory):
            if name.startswith(prefix) and name[len(prefix) :].isdigit():
                found.append(int(name[len(prefix) :]))
        return sorted(found)

    def allocate(self, slot: int, nbytes: int) -> tuple[int, int]:
        """Open `slot`'s payload file with at least `nbytes` allocated (never shrunk).

        Returns:
            `(fd, capacity)`: the open descriptor (the caller owns it) and the file's size.

        Raises:
            CheckpointError: the directory's filesystem cannot hold it (ENOSPC says how to
                size it), or the file cannot be opened.
        """
        path = self.payload_path(slot)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise CheckpointError(f"memory slot {path}: cannot open it: {err}") from err
        try:
            capacity = max(MIN_SLOT_BYTES, nbytes, os.fstat(fd).st_size)
            # Every page now: a tmpfs out of room says ENOSPC here instead of a SIGBUS later.
            os.posix_fallocate(fd, 0, capacity)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise CheckpointError(
                    f"memory slot {path}: no room for {nbytes} bytes in {self.directory} "
                    f"({os.strerror(err.errno)}); size that tmpfs for every local rank's slots "
                    "(2 or more per rank, each the rank's whole state) or turn the memory tier "
                    "off"
                ) from err
            raise CheckpointError(f"memory slot {path}: cannot allocate it: {err}") from err
        return fd, capacity

    def remove_meta(self, slot: int) -> None:
        """Mark `slot` empty (before its payload is overwritten).

        Raises:
            CheckpointError: the meta exists and cannot be removed.
        """
        try:
            os.unlink(self.meta_path(slot))
        except FileNotFoundError:
            return
        except OSError as err:
            raise CheckpointError(f"memory slot {self.meta_path(slot)}: {err}") from err

    def write_meta(self, slot: int, meta: dict[str, Any] | bytes) -> None:
        """Write `slot`'s meta atomically (its payload is complete).

        Args:
            slot: the slot.
            meta: the meta, or its file's bytes already encoded (`meta.MetaEncoder`).

        Raises:
            CheckpointError: the write failed (the slot then stays empty).
        """
        path = self.meta_path(slot)
        temp = f"{path}.tmp-{os.getpid()}"
        data = meta if isinstance(meta, bytes) else json.dumps(meta, separators=(",", ":")).encode()
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise CheckpointError(f"memory slot {path}: cannot write its meta: {err}") from err

    def meta_slots(self) -> list[int]:
        """Slots with a meta file, ascending."""
        found = []
        for name in _listdir(self.directory):
            match = self._pattern.fullmatch(name)
            if match is not None:
                found.append(int(match.group(1)))
        return sorted(found)

    def read_metas(self) -> dict[int, dict[str, Any] | str]:
        """Every slot's meta by slot: the parsed JSON object, or why it does not read."""
        found: dict[int, dict[str, Any] | str] = {}
        for name in _listdir(self.directory):
            match = self._pattern.fullmatch(name)
            if match is None:
                continue
            slot = int(match.group(1))
            try:
                with open(os.path.join(self.directory, name), "rb") as f:
                    parsed = json.loads(f.read())
            except (OSError, ValueError) as err:
                found[slot] = f"unreadable meta: {err}"
                continue
            found[slot] = parsed if isinstance(parsed, dict) else "meta is not a JSON object"
        return found


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
