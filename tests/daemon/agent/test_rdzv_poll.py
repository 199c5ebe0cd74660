"""The rendezvous poll of a waiting node ([Note: a waiting node polls the rendezvous faster on
few nodes] in `daemon/agent/rdzv_poll.py`): its interval, and that torch's real c10d handler
waits through it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from daemon.agent import rdzv_poll
from daemon.agent.rdzv_poll import SyncPollDelay, sync_poll_s
from tests.support.dist import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def torch_delay() -> Iterator[None]:
    """Torch's own `_delay` back after the test."""
    original = getattr(dynamic_rendezvous, "_delay")  # noqa: B009
    yield
    setattr(dynamic_rendezvous, "_delay", original)  # noqa: B010


def test_the_interval_grows_with_the_nodes_so_the_store_reads_stay_bounded() -> None:
    assert sync_poll_s(1) == sync_poll_s(2) == 0.05
    assert sync_poll_s(10) == pytest.approx(0.2)
    assert sync_poll_s(50) == sync_poll_s(5000) == 1.0  # torch's own second
    # Up to 50 nodes, waiting nodes read the state at most 50 times a second together; above,
    # as torch does (each once a second): never more often than torch's own pace.
    assert all(n / sync_poll_s(n) <= 50 for n in range(1, 51))
    assert all(sync_poll_s(n) <= 1.0 for n in range(1, 5000))


def test_only_the_waiting_poll_is_shortened() -> None:
    slept: list[float] = []
    passed: list[object] = []
    delay = SyncPollDelay(0.05, passed.append, sleep=slept.append)
    delay(1)
    delay((0, 0.3))  # the random back-off before a close: torch's
    delay(2)
    assert slept == [0.05]
    assert passed == [(0, 0.3), 2]


def test_install_replaces_torchs_delay_once_and_updates_the_interval(torch_delay: None) -> None:
    original = getattr(dynamic_rendezvous, "_delay")  # noqa: B009
    assert rdzv_poll.install(object(), 2) is False  # no state cache to set: said so
    first = getattr(dynamic_rendezvous, "_delay")  # noqa: B009
    assert isinstance(first, SyncPollDelay)
    assert first.original is original
    rdzv_poll.install(object(), 30)
    assert getattr(dynamic_rendezvous, "_delay") is first  # noqa: B009
    assert first.poll_s == pytest.approx(0.6)


def test_a_waiting_node_of_a_real_c10d_rendezvous_polls_at_the_short_interval(
    torch_delay: None,
) -> None:
    # Guards a torch upgrade: if its executor stopped asking `_delay(seconds=1)` by this
    # module's name, the waiting node would poll at torch's own pace and nothing here is
    # called.
    waited: list[float] = []
    polled = threading.Event()

    def recording(seconds: float) -> None:
        waited.append(seconds)
        polled.set()
        threading.Event().wait(seconds)

    endpoint = f"127.0.0.1:{free_port()}"

    def handler(is_host: bool) -> dynamic_rendezvous.DynamicRendezvousHandler:
        params = RendezvousParameters(
            backend="c10d", endpoint=endpoint, run_id="poll", min_nodes=2, max_nodes=2,
            local_addr="127.0.0.1", is_host=is_host, join_timeout=30,
        )  # fmt: skip
        made = get_rendezvous_handler(params)
        assert isinstance(made, dynamic_rendezvous.DynamicRendezvousHandler)
        assert rdzv_poll.install(made, 2) is True
        return made

    first = handler(True)
    delay = getattr(dynamic_rendezvous, "_delay")  # noqa: B009
    delay._sleep = recording
    results: dict[str, object] = {}

    def join(name: str, h: dynamic_rendezvous.DynamicRendezvousHandler) -> None:
        try:
            results[name] = h.next_rendezvous()
        except Exception as err:  # surfaced by the asserts below
            results[name] = err

    waiting = threading.Thread(target=join, args=("first", first), daemon=True)
    waiting.start()
    assert polled.wait(20), "the first node never waited for the second"
    second = handler(False)
    join("second", second)
    waiting.join(30)
    for name in ("first", "second"):
        info = results[name]
        assert not isinstance(info, Exception), info
        assert info.world_size == 2  # type: ignore[attr-defined]
    assert waited
    assert set(waited) == {0.05}
    # Each poll read the store: the state cache lives no longer than the poll.
    assert first._state_holder._cache_duration == 0.05  # type: ignore[attr-defined]
    for h in (second, first):
        h.shutdown()
