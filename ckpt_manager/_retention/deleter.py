"""Background retention and garbage collection (coordinator only, one thread).

Woken after a commit (and on a retry timer), it runs only once the run has restored or
committed ([Note: retention waits for the run's restore]) and while no save is in flight: it
lists the root, applies the retention policy to committed steps (never the newest, pinned,
restored-from or in-flight ones), deletes each dropped step manifest first (a half-deleted
step is uncommitted, never "corrupt"), and removes uncommitted leftovers (folders and
incomplete multipart uploads) older than the grace period. Failures are logged per step and
retried on the next wake; they never stop the thread, never block the other steps, and never
hold up a wait or a shutdown for more than `MAX_WAIT_S`.

[Note: whose leftover] The root's start-up removes every uncommitted folder (`drop_dead_attempts`),
so a leftover seen later was written after it, by one of two writers: this run (a save that
failed, whose folder the coordinator could not remove; or another rank that started writing a
step before the coordinator called `save()` for it), or a writer of a dead attempt still
winding down (a rank polls for its parent's death, and finishes the chunk it is writing). A
folder at or below the newest step this run has saved durably, with no save in flight, can be
neither this run's work in progress nor a step it will write again: it is collected at once.
A folder above it may be another rank of this run running ahead, so it waits out
`grace_s`, as before.

[Note: retention is not starved by back-to-back saves] Retention waits for a moment with no
save in flight, so that deletions do not compete with a save's writes. With the memory tier
the durable saves follow each other with no gap (a due save is deferred while one is in
flight, then taken at once), and such a moment may never come: a run of 80 commits had
deleted 55 steps, 25 over `keep_last`, when it was killed. So once passes have been put off
for `max_defer_s`, retention runs while a save is in flight (it never deletes the newest
committed step, and an in-flight step is not committed, so the plan is the same). The
collection of uncommitted leftovers still never runs then: the in-flight save's own folder
is one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._retention.base import RetentionPolicy, StepInfo, plan_deletions
from ckpt_manager._store.pins import pinned_steps
from ckpt_manager._store.steps import (
    abort_orphaned_uploads,
    delete_step,
    list_step_dirs,
    read_manifest,
    remove_uncommitted_step,
)
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError

__all__ = ["MAX_DEFER_S", "MAX_WAIT_S", "Deleter"]

MAX_DEFER_S = 30.0
"""Longest retention waits for a moment with no save in flight ([Note: retention is not
starved by back-to-back saves])."""
MAX_WAIT_S = 5.0
"""Longest a save, a wait or a shutdown waits for retention ([Note: retention never holds
anything up])."""

_log = structlog.get_logger("ckpt_manager.deleter")


class Deleter:
    """Owns the deletion thread of one manager."""

    def __init__(
        self,
        storage: Storage,
        policy: RetentionPolicy | None,
        *,
        saving: Callable[[], bool],
        protected: Callable[[], set[int]],
        grace_s: float,
        retry_s: float,
        newest_saved: Callable[[], int | None] = lambda: None,
        max_defer_s: float = MAX_DEFER_S,
    ) -> None:
        """Start the thread.

        Args:
            storage: the root.
            policy: retention policy (None: keep every committed step).
            saving: whether a save is in flight (the deleter then waits for the next wake).
            protected: steps never deleted (restored from).
            grace_s: age after which uncommitted leftovers above `newest_saved` are removed.
            retry_s: wake-up period (retries failed deletions).
            newest_saved: the newest step this run has saved durably (None: none yet);
                leftovers at or below it are removed at once ([Note: whose leftover]).
            max_defer_s: retention runs during a save once put off this long ([Note:
                retention is not starved by back-to-back saves]).
        """
        self._storage = storage
        self._policy = policy
        self._saving = saving
        self._protected = protected
        self._grace_s = grace_s
        self._retry_s = retry_s
        self._newest_saved = newest_saved
        self._max_defer_s = max_defer_s
        self._deferred_since: float | None = None  # monotonic; None: not put off
        self._infos: dict[int, StepInfo] = {}
        self._doomed: set[int] = set()  # deletion started (manifest may be gone): finish them
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        # Triggers so far, under `_lock`: a pass that began before the newest trigger does not
        # set `_idle` ([Note: a pass answers only the triggers it saw]).
        self._lock = threading.Lock()
        self._triggers = 0
        self._armed = threading.Event()  # no pass before the run restored or committed
        self.num_deleted = 0
        """Steps deleted by retention so far."""
        self.num_failures = 0
        """Deletion passes that failed (and were retried)."""
        self._thread = threading.Thread(target=self._run, name="ckpt-deleter", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """Allow passes from now on (the run has restored); see [Note: retention waits for
        the run's restore] in `_manager.py`. Also asks for a pass."""
        self._armed.set()
        self.trigger()

    def note_committed(
        self, step: int, committed_unix_s: float, metrics: Mapping[str, Any]
    ) -> None:
        """Remember a step this run is committing, as its manifest records it (told before
        the manifest is published, so no pass lists the step first; a step whose publish
        failed is never listed as committed, and a later commit of it replaces the entry).

        [Note: retention learns a commit from the finalizer] Each pass needs every committed
        step's commit time and metrics; it read them from the manifest of each step new to
        it, a full parse and validation of its tensor records (about 5 ms of CPU per save on
        the bench's 156-tensor state, one of the largest parts of a save's fixed work). The
        coordinator wrote that manifest a moment ago from the same values, so it hands them
        over instead. The metrics go through the manifest's JSON encoding, so a policy sees
        exactly what reading the manifest would give it (lists for tuples, string keys);
        metrics that JSON cannot carry were never committed, and leave the step to be read.
        """
        try:
            stored = json.loads(json.dumps(dict(metrics), allow_nan=True))
        except (TypeError, ValueError):
            return
        self._infos[step] = StepInfo(step, float(committed_unix_s), stored)

    def trigger(self) -> None:
        """Ask for a pass (after a commit, which also arms the deleter)."""
        self._armed.set()
        with self._lock:
            self._triggers += 1
            self._idle.clear()
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wait until a triggered pass has ended (done or failed), for at most
        `min(timeout_s, MAX_WAIT_S)`; False if it is still running.

        [Note: retention never holds anything up] A delete that keeps failing (denied, or a
        store that hangs) is logged and retried on the timer; waits for it are capped at
        `MAX_WAIT_S`, so it can delay `wait_until_finished` or a shutdown by seconds at most,
        never by the finalize timeout.
        """
        return self._idle.wait(min(timeout_s, MAX_WAIT_S))

    def close(self, timeout_s: float) -> None:
        """Stop the thread: no new deletion starts; one in progress gets at most
        `min(timeout_s, MAX_WAIT_S)` (the thread is a daemon, and a deletion cut short is
        finished by a later run: [Note: manifest first])."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=min(timeout_s, MAX_WAIT_S))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._retry_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            if not self._armed.is_set():
                continue  # the run has neither restored nor committed yet
            if self._held_back():
                continue  # a save is in flight; the manager wakes us when it settles
            with self._lock:
                seen = self._triggers
            try:
                self._pass()
                self._deferred_since = None  # a pass ran: the next one may wait again
            except CheckpointError as err:
                self.num_failures += 1
                _log.warning("ckpt_retention_failed", error=str(err), retry_in_s=self._retry_s)
            except Exception as err:  # never let the thread die; the next wake retries
                self.num_failures += 1
                _log.exception("ckpt_retention_crashed", error=str(err))
            finally:
                # [Note: a pass answers only the triggers it saw] A commit that triggers while
                # a pass runs may come after that pass listed the steps: `flush` must wait for
                # the next pass (`_wake` is set), not return on this one's end. Seen in CI:
                # step 3 still there after `wait_until_finished` under KeepLast(1). A failure
                # is retried on the timer, never waited for.
                with self._lock:
                    if self._triggers == seen:
                        self._idle.set()

    def _held_back(self) -> bool:
        """A save is in flight and retention has not been put off for `max_defer_s` yet."""
        if not self._saving():
            self._deferred_since = None
            return False
        now = time.monotonic()
        if self._deferred_since is None:
            self._deferred_since = now
        return now - self._deferred_since < self._max_defer_s

    def _info(self, step: int) -> StepInfo | None:
        found = self._infos.get(step)
        if found is not None:
            return found
        try:
            m = read_manifest(self._storage, step)
        except StepNotFoundError:
            return None
        except CorruptCheckpointError as err:
            _log.warning("ckpt_retention_skips_corrupt_step", step=step, error=str(err))
            return None
        info = self._infos[step] = StepInfo(step, m.committed_unix_s, dict(m.metrics))
        return info

    def _pass(self) -> None:
        for s in sorted(self._doomed):
            if self._held_back() or self._stop.is_set():
                return
            if s not in self._protected():
                self._delete_step(s)
        steps = list_step_dirs(self._storage)
        infos: list[StepInfo] = []
        uncommitted: list[int] = []
        for s in steps:
            info = self._info(s)
            if info is not None:
                infos.append(info)
            elif not self._storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}"):
                uncommitted.append(s)
        if self._policy is not None:
            protected = pinned_steps(self._storage) | self._protected()
            for s in plan_deletions(self._policy, infos, protected=protected):
                if self._held_back() or self._stop.is_set():
                    return  # a save started (or shutdown): stop; the next wake resumes
                if s in self._protected():
                    continue  # restored from since the plan was made
                self._delete_step(s)
        # Uploads of writers killed mid-upload, under folders that may hold nothing else
        # (see [Note: orphaned multipart uploads] in `_store/backends/multipart.py`); no save is in
        # flight, and the grace period covers a writer of another rank still winding down.
        if self._saving() or self._stop.is_set():
            return
        abort_orphaned_uploads(self._storage, older_than_s=self._grace_s)
        now = time.time()
        newest_saved = self._newest_saved()
        for s in uncommitted:
            if self._saving() or self._stop.is_set():
                return
            if s in self._protected():
                continue
            settled = newest_saved is not None and s <= newest_saved  # [Note: whose leftover]
            modified = None if settled else self._storage.modified_unix_s(step_dir(s))
            if settled or modified is None or now - modified >= self._grace_s:
                _log.info("ckpt_gc_uncommitted", ckpt_step=s)
                # Committed since the listing? Then it is kept: see [Note: a folder with a
                # manifest is never removed by a failure path] in `catalog.py`.
                remove_uncommitted_step(self._storage, s)

    def _delete_step(self, step: int) -> None:
        self._doomed.add(step)
        # [Note: manifest first] in `catalog.delete_step`; a step whose deletion stopped
        # halfway is remembered in `_doomed` and finished by the next pass.
        try:
            deleted = delete_step(self._storage, step)
        except CheckpointError as err:  # one denied step must not hold up the others
            self.num_failures += 1
            _log.warning(
                "ckpt_retention_failed", ckpt_step=step, error=str(err), retry_in_s=self._retry_s
            )
            return
        self._infos.pop(step, None)
        self._doomed.discard(step)
        if not deleted:  # pinned after the plan was made: the pin wins
            _log.info("ckpt_retention_kept_pinned", ckpt_step=step)
            return
        self.num_deleted += 1
        _log.info("ckpt_retention_deleted", ckpt_step=step)
