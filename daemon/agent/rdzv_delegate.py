"""A rendezvous handler that delegates to another: the base of the agent's handler wrappers.

`MembershipWatch`, `WaitListThrottle` (`elastic.py`) and `StoreGuard` (`store_guard.py`) each
change one or two of torch's `RendezvousHandler` methods and pass every other call through to
the handler they wrap; this class is that pass-through, written once.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

__all__ = ["DelegatingHandler"]


class DelegatingHandler(RendezvousHandler):
    """Every `RendezvousHandler` call answered by `inner`.

    Args:
        inner: the handler wrapped.
    """

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner

    def num_nodes_waiting(self) -> int:
        """As the inner handler."""
        return self._inner.num_nodes_waiting()

    @property
    def use_agent_store(self) -> bool:
        """As the inner handler."""
        return bool(self._inner.use_agent_store)

    def get_backend(self) -> str:
        """As the inner handler."""
        return self._inner.get_backend()

    def next_rendezvous(self) -> RendezvousInfo:
        """As the inner handler."""
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        """As the inner handler."""
        return self._inner.is_closed()

    def set_closed(self) -> None:
        """As the inner handler."""
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def get_run_id(self) -> str:
        """As the inner handler."""
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        """As the inner handler."""
        return self._inner.shutdown()
