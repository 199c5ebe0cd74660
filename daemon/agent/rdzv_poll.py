"""How often a node waiting in a rendezvous reads the shared rendezvous state again.

[Note: a waiting node polls the rendezvous faster on few nodes] torch's dynamic rendezvous
handler (the `c10d` and `etcd-v2` backends) reads the shared state once a second while it waits
for the other nodes: `_DistributedRendezvousOpExecutor.run` sleeps `_delay(seconds=1)` between
two reads, and its state holder (`_BackendRendezvousStateHolder`, `cache_duration=1`) answers
from a copy up to a second old anyway. A group re-forming after a failure therefore waits up to
a second after its last node arrived. On two nodes x 1 rank on loopback a rank kill cost
1.6 s from the SIGKILL to the next step, 1.0 s of it here: both agents had stopped their ranks
0.23 s after the kill and the rendezvous completed at 1.25 s (`bench/recovery.py --topologies
2x1`, the agents' `ranks_stopped` and `rendezvous_done` lines). One node alone never waits.

The second spares the store: N waiting nodes read it N times a second. The daemon shortens
the wait where the job is small and keeps torch's where it is large: a waiting node reads the
state again after `sync_poll_s(max_nodes)` = `max_nodes` x 20 ms, at least 50 ms and at most
torch's second. Up to 50 nodes the store then sees at most 50 reads a second from waiting
nodes (torch: up to 50), above that exactly torch's pace, and a group of a few nodes re-forms
within tens of milliseconds of its last arrival.

torch offers no setting for either, so `install` replaces the module's `_delay` with one that
sleeps `sync_poll_s` where torch asks for that one-second poll and passes every other delay
(the random back-off before a first join, say) to torch's own, and sets the handler's state
cache to the same interval. A torch whose executor or state holder no longer works that way
keeps its own behaviour (`install` returns whether it found the cache).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

__all__ = ["SyncPollDelay", "install", "sync_poll_s"]

_TORCH_SYNC_DELAY_S = 1
"""The delay torch's executor asks for between two reads of the state while it waits."""
_NAME = "_delay"
"""The name torch's executor calls its delay by, in `dynamic_rendezvous`."""
_CACHE = "_cache_duration"
"""The state holder's cache lifetime (seconds), in `_BackendRendezvousStateHolder`."""
_PER_NODE_S = 0.02
_MIN_S = 0.05


def sync_poll_s(max_nodes: int) -> float:
    """Seconds between two reads of the rendezvous state by a waiting node of a job of up to
    `max_nodes` nodes."""
    return min(float(_TORCH_SYNC_DELAY_S), max(_MIN_S, _PER_NODE_S * max_nodes))


class SyncPollDelay:
    """A stand-in for torch's `_delay`: `poll_s` for the waiting poll, torch's for the rest.

    Args:
        poll_s: the waiting poll's interval.
        original: torch's `_delay`.
        sleep: the sleep used for the poll (tests pass their own).
    """

    def __init__(
        self,
        poll_s: float,
        original: Callable[..., None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.poll_s = poll_s
        self.original = original
        self._sleep = sleep

    def __call__(self, seconds: float | tuple[float, float]) -> None:
        """Sleep as torch asked, or `poll_s` where it asked for the waiting poll."""
        if seconds == _TORCH_SYNC_DELAY_S:
            self._sleep(self.poll_s)
        else:
            self.original(seconds)


_lock = threading.Lock()


def install(handler: object, max_nodes: int) -> bool:
    """Make waiting nodes of this process poll every `sync_poll_s(max_nodes)`, and `handler`
    (torch's rendezvous handler) read the shared state that often; returns whether its state
    cache was found. Idempotent: a second call updates the interval."""
    poll_s = sync_poll_s(max_nodes)
    with _lock:
        current = getattr(dynamic_rendezvous, _NAME)
        if isinstance(current, SyncPollDelay):
            current.poll_s = poll_s
        else:
            setattr(dynamic_rendezvous, _NAME, SyncPollDelay(poll_s, current))
    holder = getattr(handler, "_state_holder", None)
    if holder is None or not hasattr(holder, _CACHE):
        return False
    setattr(holder, _CACHE, poll_s)
    return True
