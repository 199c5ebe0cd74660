"""Rendezvous-store outages are ridden out while the ranks train, up to a grace period.

[Note: a store outage is not a crash]
torch's agent asks the rendezvous store, every monitor interval, how many nodes wait to join
(`num_nodes_waiting`). When the store does not answer (c10d: node 0's daemon paused, its host
overloaded, a network blip; etcd-v2: the etcd server restarting), torch lets the error end the
agent, so one paused daemon took the whole job down with raw tracebacks (issue 32). Yet the
ranks do not need the store while they train: their process group has its own. So
`StoreGuard` answers "nobody waits" during an outage: the ranks keep training and the agent
keeps watching them, and it asks the store again at the next check; the first answer ends the
outage (`rendezvous_store_back`). A c10d client whose server is paused (SIGSTOP) does not time
out at `rdzv_store_timeout_s`: it blocks until the server runs again, then fails once and works
after. So the calls run on one worker thread and the guard waits for each at most what is left
of the grace: a call that has not come back by then, or an outage that lasted longer, ends this
node's run with `StoreLostError`, which the daemon turns into exit 75 with one line (restart
me; the store's host is lost). Each outage is one `store_outage` incident
(`daemon/observe/incidents.py`): recovered when the store answers again, fatal when the node's
run ends on it. The outage counts from the start of the call that failed. A store
that is gone for good (its host SIGKILLed) fails at once, and the ranks fail in their next
collective; the agent's restart then cannot rendezvous and the daemon exits 75 the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousTimeoutError,
)

from daemon.agent.rdzv_delegate import DelegatingHandler
from daemon.observe.incidents import IncidentKind, IncidentLog

__all__ = ["StoreGuard", "StoreLostError"]

log = structlog.get_logger("trainingd.elastic")

_STORE_ERRORS = (RendezvousConnectionError, RendezvousTimeoutError, DistError, TimeoutError)
"""What an unreachable store raises: torch's rendezvous wraps its store errors in
`RendezvousConnectionError`; the store's own `DistError`s (`DistStoreError`,
`DistNetworkError`) and timeouts are taken too, whatever layer lets them through."""


class StoreLostError(RendezvousConnectionError):
    """The rendezvous store stayed unreachable for longer than the grace period."""


class StoreGuard(DelegatingHandler):
    """A rendezvous handler whose wait-list check rides out store outages.

    Everything is delegated to `inner`; `num_nodes_waiting` answers 0 while the store is
    unreachable, for up to `grace_s` ([Note: a store outage is not a crash]).

    Args:
        inner: the real (c10d or etcd-v2) handler.
        endpoint: the store's `host:port`, for log lines and the error.
        grace_s: how long an outage may last before `StoreLostError`.
        clock: a monotonic clock (tests pass their own).
        incidents: where each outage is an incident (left open when it ends the run: the
            daemon makes it fatal); None: nowhere.
    """

    def __init__(
        self,
        inner: RendezvousHandler,
        *,
        endpoint: str,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        incidents: IncidentLog | None = None,
    ) -> None:
        super().__init__(inner)
        self._incidents = incidents
        self._incident_id: int | None = None
        self._endpoint = endpoint
        self._grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._lost: StoreLostError | None = None
        self._caller = _Caller()
        self.num_outages = 0
        """Outages seen so far (each ended or still going)."""

    @property
    def outage_s(self) -> float:
        """How long the current outage has lasted (0 when the store answers)."""
        with self._lock:
            return 0.0 if self._since is None else self._clock() - self._since

    def num_nodes_waiting(self) -> int:
        """The inner answer; 0 while the store is unreachable, within the grace.

        Raises:
            StoreLostError: the store has not answered for longer than the grace.
        """
        if self._lost is not None:
            raise self._lost
        started = self._clock()
        with self._lock:
            left_s = self._grace_s - (0.0 if self._since is None else started - self._since)
        try:
            if left_s <= 0:
                raise _GaveUpError
            waiting = int(self._caller.call(self._inner.num_nodes_waiting, left_s))
        except _STORE_ERRORS as err:
            self._failed(err, started)
            return 0
        except _GaveUpError:
            self._failed(TimeoutError("no answer"), started, gave_up=True)
            return 0  # not reached: `_failed` raises once the grace is spent
        self._answered()
        return waiting

    def _failed(self, err: BaseException, started: float, *, gave_up: bool = False) -> None:
        now = self._clock()
        with self._lock:
            first = self._since is None
            if first:
                self._since = started
                self.num_outages += 1
            lasted = now - (self._since if self._since is not None else started)
        reason = _one_line(err)
        if first and self._incidents is not None:
            self._incident_id = self._incidents.open(
                IncidentKind.STORE_OUTAGE,
                ranks=(),
                cause=f"rendezvous store at {self._endpoint} unreachable: {reason}",
                fault_unix_s=time.time() - (now - started),
                awaits_restart=False,
            ).id
        if first:
            log.warning(
                "rendezvous_store_unreachable",
                endpoint=self._endpoint,
                error=reason,
                grace_s=self._grace_s,
                note="the ranks keep training; the store is asked again at the next check",
            )
        if gave_up or lasted > self._grace_s:
            self._lost = StoreLostError(
                f"the rendezvous store at {self._endpoint} did not answer for {lasted:.0f} s "
                f"(rdzv_store_grace_s={self._grace_s:g}): {reason}"
            )
            raise self._lost

    def _answered(self) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            if self._incidents is not None and self._incident_id is not None:
                self._incidents.recover(self._incident_id)
                self._incident_id = None
            log.warning(
                "rendezvous_store_back",
                endpoint=self._endpoint,
                outage_s=round(self._clock() - since, 1),
            )

    def shutdown(self) -> bool:
        """As the inner handler; False at once when the store is lost (it would block)."""
        if self._lost is not None:
            return False
        return self._inner.shutdown()


class _GaveUpError(Exception):
    """A store call did not come back in the time it was given."""


class _Caller:
    """Makes calls on one worker thread, so that a caller can stop waiting for a stuck one.

    The thread is a daemon thread that lives as long as the process: a call stuck in a paused
    store's socket may never return, and it must not hold the daemon's exit.
    """

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """`fn()`, or its exception; `_GaveUpError` when it takes longer than `timeout_s`."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="rdzv-store-calls", daemon=True
            )
            self._thread.start()
        box: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._requests.put((fn, box))
        try:
            ok, value = box.get(timeout=timeout_s)
        except queue.Empty:
            raise _GaveUpError from None
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, box = self._requests.get()
            try:
                box.put((True, fn()))
            except BaseException as err:  # handed to the caller, which raises it
                box.put((False, err))


def _one_line(err: BaseException) -> str:
    """`Type: first line` of an error and of its cause (torch's store errors span pages)."""
    parts = [err, err.__cause__] if err.__cause__ is not None else [err]
    return "; ".join(
        f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}" for e in parts
    )
