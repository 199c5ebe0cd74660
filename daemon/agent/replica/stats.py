"""The replica service's counters, read by the daemon's collector at scrape time.

Plain numbers under one lock (the sender, the server's connection threads and the fetch all
count); `values()` maps them to the catalog's `trainingd_memory_replica_*` families.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import structlog

from daemon.agent.replica.protocol import Refusal

__all__ = ["ReplicaStats"]

_log = structlog.get_logger("trainingd.replica")


class ReplicaStats:
    """Bytes, seconds, failures and lag of this node's replicas."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent_bytes = 0
        """Payload bytes streamed to the peer and acknowledged."""
        self.send_s = 0.0
        """Seconds spent streaming those payloads (first byte to last, not the ack)."""
        self.received_bytes = 0
        """Payload bytes received (replicas held here and fetched copies)."""
        self.receive_s = 0.0
        """Seconds spent receiving them."""
        self.failures: dict[str, int] = {r.value: 0 for r in Refusal}
        """Refused or failed replicas by reason."""
        self._newest_local: dict[int, int] = {}
        self._acked: dict[int, int] = {}

    def sent(self, nbytes: int, seconds: float) -> None:
        """A payload was streamed and acknowledged."""
        with self._lock:
            self.sent_bytes += nbytes
            self.send_s += seconds

    def received(self, nbytes: int, seconds: float) -> None:
        """A payload arrived."""
        with self._lock:
            self.received_bytes += nbytes
            self.receive_s += seconds

    def failed(self, reason: Refusal, event: str, **context: object) -> None:
        """Count and log a refused or failed replica."""
        with self._lock:
            self.failures[reason.value] += 1
        _log.warning(event, reason=reason.value, **context)

    def local_step(self, rank: int, step: int) -> None:
        """Rank `rank`'s newest complete local snapshot is `step`."""
        with self._lock:
            self._newest_local[rank] = step

    def acked_step(self, rank: int, step: int) -> None:
        """The peer acknowledged rank `rank`'s snapshot of `step`."""
        with self._lock:
            self._acked[rank] = max(step, self._acked.get(rank, step))

    def forget_acks(self, ranks: list[int]) -> None:
        """A new ring: nothing is acknowledged by the new peer yet; only `ranks` are local."""
        with self._lock:
            self._acked.clear()
            self._newest_local = {r: s for r, s in self._newest_local.items() if r in ranks}

    def lag_steps(self) -> float:
        """Newest local complete step minus the newest one the peer acknowledged, max over
        local ranks (a rank with nothing acknowledged lags by its step + 1)."""
        with self._lock:
            lags = [s - self._acked.get(r, -1) for r, s in self._newest_local.items()]
        return float(max(lags, default=0))

    def values(self) -> Mapping[str, Mapping[str, float]]:
        """The catalog's replica families: name -> label value ("" without one) -> value."""
        lag = self.lag_steps()
        with self._lock:
            return {
                "trainingd_memory_replica_lag_steps": {"": lag},
                "trainingd_memory_replica_sent_bytes_total": {"": float(self.sent_bytes)},
                "trainingd_memory_replica_send_seconds_total": {"": self.send_s},
                "trainingd_memory_replica_received_bytes_total": {"": float(self.received_bytes)},
                "trainingd_memory_replica_receive_seconds_total": {"": self.receive_s},
                "trainingd_memory_replica_failures_total": {
                    k: float(v) for k, v in self.failures.items()
                },
            }
