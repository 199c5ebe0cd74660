"""Opening the durable root on the coordinator: the lease, the retention record, dead attempts.

[Note: a rank starts while its durable root is unreachable]
Opening the root needs the storage: the lease document, the retention record and the listing
of dead attempts. Without the memory tier a run cannot restore anything without the storage
either, so the root is opened at start and a failure raises there, on every rank. With the
memory tier, a rank killed during a storage outage must restore from memory and train on
(issue 29), and an unreachable S3 endpoint makes botocore retry for minutes. So with the
memory tier the coordinator first probes the root (`check_root_writable`: one connection and
one request, each bounded by `PROBE_TIMEOUT_S`):
  - the probe passes: the root is opened at start, as without the tier;
  - the probe fails: the start does not. The root is *pending*: the coordinator opens it on a
    background thread (`BackgroundOpen`), retrying while its failure is transient (an
    unreachable store, a timeout, 5xx), and the other ranks learn the outcome at the first
    durable save, the one collective point that needs the root. Meanwhile
    `CheckpointManager.write_in_flight()` is True on the coordinator, so a caller that defers
    durable saves behind a write still in flight (trainingd's loop) defers them behind the
    opening too; a durable save reached anyway waits for the opening up to `write_timeout_s`
    and fails as a save (`SaveFailedError`) if it is still pending. A memory restore reads no
    storage; a durable restore reads committed steps, which needs no lease.

[Note: the root opens after a memory restore]
Opening the root reads and writes the storage (the lease document, the retention record, the
newest manifest for its commit time: on S3 about ten requests, 0.2-1 s on a busy store), and
none of it is needed by a restore from memory, which must read nothing from storage (issue
29). So when the coordinator's memory tier already holds a snapshot of this run at start (a
restart: its ranks will restore from memory), the opening is *deferred*: every rank starts with
the root pending, and nothing touches the storage until one of
  - the first `save()` after the start (memory or durable), or the second
    `write_in_flight()` (a caller that never stalls on storage asks it once per step, so the
    run has then completed a step past the restore: the recovery itself stays storage-free):
    the coordinator starts the background opening, and the run trains on meanwhile, exactly
    as with a root unreachable at start (`write_in_flight()` is True on the coordinator until
    the root is open, so such a caller defers a durable save due meanwhile; a durable save
    reached anyway waits for the opening in `_sync_root`);
  - a restore that reads the durable tier (the memory restore failed, or an explicit step):
    the root is opened there and then, synchronously as at a first start, so a corrupt step
    can be moved aside under the lease.
A first start (no snapshot of this run in memory) opens the root synchronously as before, so
a second run on the same root still fails at its start.

What the memory restore cannot know without the root: a step committed by ranks none of which
is in this world (an elastic shrink, then every node that went on alone lost). The ranks'
durable floors ([Note: a memory step older than a durable one is stale] in
`_memory/floor.py`) cover every commit a rank of this world saw; for the rest, once the opening
ends its newest committed step is compared with the step restored from memory (on the
coordinator at its next call, on every rank at the first durable save, before anything is
written): a restore that went back past a commit raises `StaleMemoryRestoreError` after
dropping the tier's snapshots and recording the commit as its floor, so the restart restores
that commit from the durable tier. The cost of that rare case is one restart; the common
restart reads no storage until it trains again.
"""

from __future__ import annotations

import dataclasses
import threading

import structlog

from ckpt_manager._config import CheckpointConfig
from ckpt_manager._retention.record import record_retention
from ckpt_manager._store.backend_errors import is_transient
from ckpt_manager._store.lease import Lease
from ckpt_manager._store.probe import check_root_writable
from ckpt_manager._store.steps import drop_dead_attempts
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError, LeaseHeldError

__all__ = [
    "PROBE_TIMEOUT_S",
    "BackgroundOpen",
    "Opened",
    "RootOutcome",
    "open_root",
    "outcome_of",
    "probe_root",
]

PROBE_TIMEOUT_S = 3.0
"""How long each network step of the start-up probe may take (connect, one request)."""
_FIRST_RETRY_S = 1.0
_MAX_RETRY_S = 30.0

_log = structlog.get_logger("ckpt_manager")


@dataclasses.dataclass(frozen=True)
class Opened:
    """What the coordinator holds once the root is open."""

    lease: Lease
    latest: tuple[int, float] | None
    """The newest committed step and its commit time (Unix s), or None."""


@dataclasses.dataclass(frozen=True)
class RootOutcome:
    """An opening's outcome, as every rank learns it (small and picklable).

    `kind`: `ok`, `lease` (another live run holds the root), `error` (anything else),
    `pending` (still being opened in the background) or `deferred` (not opened yet: [Note:
    the root opens after a memory restore]).
    """

    kind: str
    message: str = ""
    latest: tuple[int, float] | None = None


def open_root(storage: Storage, run_id: str, config: CheckpointConfig) -> Opened:
    """Take the lease, record the retention policy and drop dead attempts (coordinator).

    Raises:
        LeaseHeldError: another live run holds the root.
        CheckpointError: the storage failed (the lease taken here is released first).
    """
    lease = Lease(storage, run_id, config.lease_ttl_s)
    lease.acquire()
    try:
        record_retention(storage, run_id, config.retention)
        latest = drop_dead_attempts(storage)
    except BaseException:
        lease.release()
        raise
    return Opened(lease, latest)


def probe_root(storage: Storage, config: CheckpointConfig) -> str | None:
    """Why the root cannot be reached now (one bounded probe), or None when it can."""
    try:
        check_root_writable(storage.root_uri, config.storage_options, timeout_s=PROBE_TIMEOUT_S)
    except CheckpointError as err:
        return str(err)
    return None


def outcome_of(err: BaseException) -> RootOutcome:
    """The outcome every rank raises for a failed opening."""
    kind = "lease" if isinstance(err, LeaseHeldError) else "error"
    return RootOutcome(kind, str(err))


class BackgroundOpen:
    """The coordinator's opening of a root that was unreachable at start, on its own thread.

    It retries while the failure is transient (delays from 1 s, doubling up to 30 s) and
    stops at the first success or at a failure that is not (another run's lease, a refusal),
    or when closed.

    Args:
        storage: the root.
        run_id: this run (the lease's).
        config: the manager's configuration.
        unreachable: why the start-up probe failed (logged once).
    """

    def __init__(
        self, storage: Storage, run_id: str, config: CheckpointConfig, unreachable: str
    ) -> None:
        self._storage = storage
        self._run_id = run_id
        self._config = config
        self._done = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._opened: Opened | None = None
        self._failure: BaseException | None = None
        self.last_error = unreachable
        """The newest reason the root is not open yet."""
        self.attempts = 0
        """Attempts made so far."""
        self._thread = threading.Thread(target=self._run, name="ckpt-root-open", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = _FIRST_RETRY_S
        while not self._closed.is_set():
            self.attempts += 1
            try:
                opened = open_root(self._storage, self._run_id, self._config)
            except Exception as err:
                self.last_error = str(err)
                if isinstance(err, CheckpointError) and is_transient(err):
                    self._closed.wait(delay)
                    delay = min(delay * 2, _MAX_RETRY_S)
                    continue
                with self._lock:
                    self._failure = err
                self._done.set()
                return
            with self._lock:
                if self._closed.is_set():  # closed meanwhile: nobody takes the lease over
                    opened.lease.release()
                    return
                self._opened = opened
            _log.info("ckpt_root_opened", attempts=self.attempts)
            self._done.set()
            return

    def done(self) -> bool:
        """Whether it has ended (opened, or failed for good)."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> RootOutcome:
        """The outcome, waiting up to `timeout_s` for it; `pending` if it has not ended."""
        self._done.wait(timeout_s)
        with self._lock:
            if self._opened is not None:
                return RootOutcome("ok", latest=self._opened.latest)
            if self._failure is not None:
                return outcome_of(self._failure)
        return RootOutcome(
            "pending",
            f"the checkpoint root is not open yet after {self.attempts} attempt(s): "
            f"{self.last_error}",
        )

    def take(self) -> Opened:
        """The opened root (after `wait` answered `ok`); the caller owns its lease now."""
        with self._lock:
            opened, self._opened = self._opened, None
        if opened is None:
            raise CheckpointError("the checkpoint root was not opened (or was taken already)")
        return opened

    def close(self, timeout_s: float) -> None:
        """Stop retrying; a lease taken and never handed over is released."""
        with self._lock:
            self._closed.set()
            opened, self._opened = self._opened, None
        if opened is not None:
            opened.lease.release()
        self._thread.join(timeout_s)
