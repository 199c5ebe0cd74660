"""One root, one writer: the lease object `_LEASE.json` at the checkpoint root.

The coordinator of a run writes `{run_id, host, pid, acquired_unix_s, refreshed_unix_s,
ttl_s}` and a refresh thread rewrites it every `ttl_s / 3`. Acquisition:

    no lease                          -> create it (exclusive create)
    same run id                       -> take over, warn (the run restarted)
    holder expired (not refreshed     -> take over, warn
      within its ttl) or dead (same host, pid gone)
    otherwise                         -> LeaseHeldError naming the holder
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

import structlog

from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError, LeaseHeldError, ObjectExistsError

__all__ = ["LEASE_NAME", "Lease", "holder_is_live", "read_lease"]

LEASE_NAME = "_LEASE.json"
_log = structlog.get_logger("ckpt_manager.lease")


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The current lease, or None when absent or unreadable."""
    try:
        doc = json.loads(storage.read(LEASE_NAME))
    except (CheckpointError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "run_id" in doc else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_is_live(doc: dict[str, Any], now: float) -> bool:
    """Whether a lease document names a live holder at time `now` (Unix seconds).

    Expired (not refreshed within its ttl) is dead; on this host a holder whose pid is gone
    is dead; a holder on another host within its ttl is live.
    """
    refreshed = float(doc.get("refreshed_unix_s", 0.0))
    ttl = float(doc.get("ttl_s", 0.0))
    if now - refreshed > ttl:
        return False
    if doc.get("host") == socket.gethostname():
        return _pid_alive(int(doc.get("pid", -1)))
    return True


class Lease:
    """The lease of one run on one root (held by the coordinator rank only)."""

    def __init__(self, storage: Storage, run_id: str, ttl_s: float) -> None:
        """Prepare; nothing is written until `acquire()`."""
        self._storage = storage
        self.run_id = run_id
        """This run."""
        self.ttl_s = ttl_s
        """Lease lifetime without refresh."""
        self._acquired_unix_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _doc(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "acquired_unix_s": self._acquired_unix_s,
            "refreshed_unix_s": time.time(),
            "ttl_s": self.ttl_s,
        }

    def acquire(self) -> None:
        """Take the lease and start refreshing it.

        Raises:
            LeaseHeldError: another live run holds the root.
            StorageError: the lease cannot be written.
        """
        self._acquired_unix_s = time.time()
        current = read_lease(self._storage)
        if current is None:
            try:
                self._storage.write(LEASE_NAME, json.dumps(self._doc()).encode(), exclusive=True)
            except ObjectExistsError:
                current = read_lease(self._storage)
                if current is None:
                    raise
        if current is not None:
            self._take_over(current)
        self._thread = threading.Thread(target=self._refresh_loop, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _take_over(self, current: dict[str, Any]) -> None:
        holder = (
            f"run {current.get('run_id')!r} (host {current.get('host')}, pid {current.get('pid')}, "
            f"refreshed {time.time() - float(current.get('refreshed_unix_s', 0.0)):.0f} s ago)"
        )
        if current.get("run_id") == self.run_id:
            _log.warning("ckpt_lease_taken_over", reason="same run restarted", holder=holder)
        elif holder_is_live(current, time.time()):
            raise LeaseHeldError(
                f"checkpoint root {self._storage.root_uri} is held by {holder}; stop that run, "
                f"use another root, or wait {float(current.get('ttl_s', 0)):.0f} s for the lease "
                "to expire"
            )
        else:
            _log.warning("ckpt_lease_taken_over", reason="holder expired or dead", holder=holder)
        self._storage.write(LEASE_NAME, json.dumps(self._doc()).encode())
        confirmed = read_lease(self._storage)
        if confirmed is None or confirmed.get("run_id") != self.run_id:
            other = confirmed.get("run_id") if confirmed else None
            raise LeaseHeldError(
                f"checkpoint root {self._storage.root_uri}: run {other!r} took the lease first"
            )

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._storage.write(LEASE_NAME, json.dumps(self._doc()).encode())
            except CheckpointError as err:
                _log.warning("ckpt_lease_refresh_failed", error=str(err))

    def release(self) -> None:
        """Stop refreshing and delete the lease if it is still ours (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.ttl_s))
            self._thread = None
        current = read_lease(self._storage)
        if current is not None and current.get("run_id") == self.run_id:
            try:
                self._storage.remove(LEASE_NAME)
            except CheckpointError as err:
                _log.warning("ckpt_lease_release_failed", error=str(err))
