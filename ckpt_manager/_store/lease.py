"""One root, one writer: the lease object `_LEASE.json` at the checkpoint root.

The coordinator of a run holds it. The document::

    {run_id, owner, host, boot_id, pid_ns, pid, acquired_unix_s, refreshed_unix_s,
     refresh_count, ttl_s, released}

`owner` is a random token per `Lease`: the run id says nothing about who holds the root (a
second launch of the same job has the same default run id). Every write of the document is
conditional on the version this process last read or wrote (`Storage.write_if`: S3 ETag
with `If-Match` / `If-None-Match`, a locked compare-and-swap locally), so of two processes
racing for the lease exactly one wins, and a holder whose lease was taken can no longer
write it. Acquisition (coordinator, at start)::

    no lease, a released one, or a holder   -> take it, conditional on the version read
      provably dead (same host, boot id and
      PID namespace, and its pid is gone)
    otherwise (whatever its run id)         -> watch its version on our monotonic clock:
      it moves (the holder refreshed)       -> LeaseHeldError naming host, pid, run id and
                                               last refresh
      unchanged for the holder's ttl        -> take over, conditional on that version
        (and at least our own `ttl_s`)

[Note: lease expiry without comparing clocks] The wall-clock times in the document are for
people (`ckptctl list`); no decision compares them with this host's clock, which may be
skewed. A holder refreshes every `ttl_s / 3`, so a version that does not move for a whole
ttl, as timed by the would-be taker's own monotonic clock, means the holder has stopped
(dead, stopped or partitioned away). A pid is only trusted "dead" where it means something:
same host name, same boot and same PID namespace (containers share host names and reuse
pids).

[Note: fencing] A holder that stops refreshing (SIGSTOP, a long GC pause, a partition) can
come back after its lease was taken over. Its next refresh finds another version and marks
the lease lost; `confirm()`, called by the coordinator right before each manifest write,
reads the lease and raises `LeaseLostError` naming the new holder unless it is still at the
version this process last wrote. The check and the manifest write are two requests, so a
holder frozen between them for a whole ttl could still write one manifest; the exclusive
manifest write then keeps it from overwriting the new holder's commit of the same step.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

import structlog

from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    CheckpointError,
    LeaseHeldError,
    LeaseLostError,
    ObjectNotFoundError,
    VersionMismatchError,
)

__all__ = [
    "LEASE_NAME",
    "Lease",
    "check_root_lease",
    "describe_holder",
    "holder_is_provably_dead",
    "read_lease",
]

LEASE_NAME = "_LEASE.json"
_MAX_POLL_S = 1.0
_log = structlog.get_logger("ckpt_manager.lease")


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return None


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "run_id" in doc else None


def _read(storage: Storage) -> tuple[dict[str, Any] | None, str | None, bool]:
    """`(document or None when unreadable, version or None when absent, present)`."""
    try:
        data, version = storage.read_with_version(LEASE_NAME)
    except ObjectNotFoundError:
        return None, None, False
    return _parse(data), version, True


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The current lease, or None when absent, released or unreadable."""
    try:
        # One GET even when absent (`Storage.read` of a missing object costs S3 a HEAD and a
        # LIST through s3fs): `ckptctl list` reads it on every call.
        doc = _parse(storage.read_with_version(LEASE_NAME)[0])
    except CheckpointError:
        return None
    return None if doc is None or doc.get("released") else doc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_is_provably_dead(doc: dict[str, Any]) -> bool:
    """Whether the holder's process is known to be gone: same host, boot and PID namespace
    as this process, and no process with its pid. Anything else may be alive."""
    boot, namespace = _boot_id(), _pid_namespace()
    same_place = (
        doc.get("host") == socket.gethostname()
        and boot is not None
        and doc.get("boot_id") == boot
        and namespace is not None
        and doc.get("pid_ns") == namespace
    )
    pid = doc.get("pid")
    return same_place and isinstance(pid, int) and pid > 0 and not _pid_alive(pid)


def describe_holder(doc: dict[str, Any] | None) -> str:
    """`run 'R' (host H, pid P, refresh #N, last refresh <UTC time> by its clock)`."""
    if doc is None:
        return "an unreadable lease"
    refreshed = float(doc.get("refreshed_unix_s") or 0.0)
    stamp = datetime.datetime.fromtimestamp(refreshed, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (
        f"run {doc.get('run_id')!r} (host {doc.get('host')}, pid {doc.get('pid')}, "
        f"refresh #{doc.get('refresh_count', '?')}, last refresh {stamp} by its clock)"
    )


def _watch(storage: Storage, version: str, wait_s: float) -> bool:
    """Watch the lease at `version` for up to `wait_s` of our monotonic clock.

    Returns:
        True when it did not move (the holder is not refreshing); False when it is gone or
        was released meanwhile (look again).

    Raises:
        LeaseHeldError: it moved to a live holder's new version (the holder refreshed).
    """
    poll_s = min(_MAX_POLL_S, max(wait_s / 20, 0.01))
    start = time.monotonic()
    while time.monotonic() - start < wait_s:
        time.sleep(poll_s)
        now_doc, now_version, present = _read(storage)
        if not present or (now_doc is not None and now_doc.get("released")):
            return False
        if now_version != version:
            raise LeaseHeldError(
                f"checkpoint root {storage.root_uri} is held by {describe_holder(now_doc)}, "
                "which refreshed its lease while we watched: stop that run or use another root"
            )
    return True


def check_root_lease(
    root_uri: str,
    storage_options: dict[str, Any] | None = None,
    *,
    joining_run_id: str | None = None,
) -> None:
    """Refuse a root a live process holds (a start-up check; takes nothing).

    Watches the lease for up to half its holder's ttl (a live holder refreshes every third
    of it), without comparing clocks. A lease that does not move is left to the manager's
    own acquisition, which waits a whole ttl before taking it over.

    Args:
        root_uri: the checkpoint root.
        storage_options: fsspec options (S3 endpoint, credentials).
        joining_run_id: the run a process joins while it trains (a node rejoining an elastic
            job): a lease held by that run is expected and passes.

    Raises:
        LeaseHeldError: the holder refreshed while we watched; the message names it.
        StorageError: the lease cannot be read.
    """
    storage = Storage(root_uri, storage_options)
    doc, version, present = _read(storage)
    if not present or version is None or doc is None or doc.get("released"):
        return
    if holder_is_provably_dead(doc):
        return
    if joining_run_id is not None and doc.get("run_id") == joining_run_id:
        return
    _watch(storage, version, float(doc.get("ttl_s") or 0.0) / 2)


class Lease:
    """The lease of one run on one root (held by the coordinator rank only)."""

    def __init__(self, storage: Storage, run_id: str, ttl_s: float) -> None:
        """Prepare; nothing is written until `acquire()`."""
        self._storage = storage
        self.run_id = run_id
        """This run."""
        self.ttl_s = ttl_s
        """Lease lifetime without refresh."""
        self.owner = uuid.uuid4().hex
        """This holder's token (the run id does not identify a holder)."""
        self._acquired_unix_s = 0.0
        self._count = 0
        self._version: str | None = None
        self._lost: str | None = None
        self._lock = threading.Lock()  # the refresh thread vs confirm()/release()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lost(self) -> bool:
        """Whether another process took the lease over (this run is fenced)."""
        return self._lost is not None

    def _doc(self, *, released: bool = False) -> bytes:
        return json.dumps(
            {
                "run_id": self.run_id,
                "owner": self.owner,
                "host": socket.gethostname(),
                "boot_id": _boot_id(),
                "pid_ns": _pid_namespace(),
                "pid": os.getpid(),
                "acquired_unix_s": self._acquired_unix_s,
                "refreshed_unix_s": time.time(),
                "refresh_count": self._count,
                "ttl_s": self.ttl_s,
                "released": released,
            }
        ).encode()

    def _write(self, expected: str | None, *, released: bool = False) -> None:
        """One conditional write of our document (count already advanced)."""
        data = self._doc(released=released)
        try:
            self._version = self._storage.write_if(LEASE_NAME, data, expected_version=expected)
        except VersionMismatchError:
            # An S3 PUT whose reply was lost may have landed: then the lease is ours.
            doc, version, _ = _read(self._storage)
            if (
                doc is None
                or doc.get("owner") != self.owner
                or doc.get("refresh_count") != (self._count)
            ):
                raise
            self._version = version

    def acquire(self) -> None:
        """Take the lease and start refreshing it.

        Waits at most the holder's ttl (and our own) when the lease is held by a process
        that has stopped refreshing; see [Note: lease expiry without comparing clocks].

        Raises:
            LeaseHeldError: another live process holds the root (whatever its run id).
            StorageError: the lease cannot be read or written.
        """
        self._acquired_unix_s = time.time()
        for _ in range(8):
            doc, version, present = _read(self._storage)
            if present and (doc is None or not doc.get("released")):
                if doc is not None and holder_is_provably_dead(doc):
                    reason = "holder's process is gone"
                else:
                    wait_s = max(self.ttl_s, float((doc or {}).get("ttl_s") or 0.0))
                    _log.info(
                        "ckpt_lease_waiting",
                        holder=describe_holder(doc),
                        expires_in_at_most_s=round(wait_s, 1),
                    )
                    assert version is not None
                    if not _watch(self._storage, version, wait_s):
                        continue
                    reason = f"not refreshed for {wait_s:.1f} s as observed here"
                _log.warning("ckpt_lease_taken_over", reason=reason, holder=describe_holder(doc))
            try:
                self._write(version)
            except VersionMismatchError:
                continue  # another process wrote first: look at the new holder
            break
        else:
            doc, _, _ = _read(self._storage)
            raise LeaseHeldError(
                f"checkpoint root {self._storage.root_uri}: the lease kept changing hands; "
                f"now held by {describe_holder(doc)}"
            )
        self._thread = threading.Thread(target=self._refresh_loop, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _mark_lost(self) -> str:
        doc, _, present = _read(self._storage)
        holder = describe_holder(doc) if present else "nobody (the lease was removed)"
        self._lost = (
            f"the lease on checkpoint root {self._storage.root_uri} was taken over; it is now "
            f"held by {holder}"
        )
        _log.error("ckpt_lease_lost", run_id=self.run_id, detail=self._lost)
        return self._lost

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                if self._lost is not None or self._stop.is_set():
                    return
                self._count += 1
                try:
                    self._write(self._version)
                except VersionMismatchError:
                    self._mark_lost()
                    return
                except CheckpointError as err:
                    _log.warning("ckpt_lease_refresh_failed", error=str(err))

    def confirm(self) -> None:
        """Check that this process still holds the lease (see [Note: fencing]).

        Raises:
            LeaseLostError: the lease was taken over (the message names the new holder).
            StorageError: the lease cannot be read.
        """
        with self._lock:
            if self._lost is None:
                try:
                    _, version = self._storage.read_with_version(LEASE_NAME)
                except ObjectNotFoundError:
                    version = None
                if version != self._version:
                    self._mark_lost()
            if self._lost is not None:
                raise LeaseLostError(f"{self._lost}: this run is fenced and commits nothing")

    def release(self) -> None:
        """Stop refreshing and mark the lease released if it is still ours (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.ttl_s))
            self._thread = None
        with self._lock:
            if self._lost is not None or self._version is None:
                return
            self._count += 1
            try:
                self._write(self._version, released=True)
            except VersionMismatchError:
                self._mark_lost()
            except CheckpointError as err:
                _log.warning("ckpt_lease_release_failed", error=str(err))
