"""Striped replica puts on real sockets (127.0.0.1): a large snapshot arrives byte exact over
several connections, a stripe that breaks fails its put without harm, and a receiver that
takes no stripes gets the whole payload on one connection ([Note: replica payloads go over
parallel streams] in `daemon/agent/replica/stripes.py`)."""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_manager import CheckpointConfig, CheckpointManager, MemoryTierConfig
from ckpt_manager.memory_slots import SlotFiles, verify_slot
from daemon.agent.replica.holdings import ReplicaHoldings
from daemon.agent.replica.protocol import (
    ProtocolError,
    recv_exact,
    recv_frame,
    recv_meta,
    send_frame,
    send_meta,
)
from daemon.agent.replica.sender import ReplicaSender, Ring
from daemon.agent.replica.server import ReplicaServer
from daemon.agent.replica.stats import ReplicaStats
from daemon.agent.replica.stripes import (
    MAX_STRIPES,
    STRIPE_MIN_BYTES,
    StripeBoard,
    stripe_count,
    stripe_ranges,
)
from tests.daemon._daemon_proc import wait_for

pytestmark = pytest.mark.timeout(60)

RUN = "run-s"
_STATE_BYTES = 24 << 20  # six stripes' worth: a 4-stream sender stripes it 4 ways


@pytest.mark.parametrize("nbytes", [0, 1, 1 << 20, (5 << 20) + 3, 24 << 20, (256 << 20) + 4096])
@pytest.mark.parametrize("stripes", [1, 2, 3, 4, 7, 16])
def test_stripes_cover_the_payload_once_and_both_sides_cut_it_alike(
    nbytes: int, stripes: int
) -> None:
    ranges = stripe_ranges(nbytes, stripes)
    assert 1 <= len(ranges) <= stripes
    assert ranges[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    assert sum(n for _, n in ranges) == nbytes
    # The receiver answers with how many it took; the sender cuts with that number.
    assert stripe_ranges(nbytes, len(ranges)) == ranges


def test_only_payloads_of_two_minimum_stripes_or_more_are_striped() -> None:
    assert stripe_count(2 * STRIPE_MIN_BYTES - 1, 4) == 1
    assert stripe_count(2 * STRIPE_MIN_BYTES, 4) == 2
    assert stripe_count(1 << 30, 4) == 4
    assert stripe_count(1 << 30, 64) == MAX_STRIPES


def _snapshot(directory: Path, step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = CheckpointConfig(memory=MemoryTierConfig(str(directory)))
    gen = torch.Generator().manual_seed(step)
    state = {"w": torch.rand(_STATE_BYTES // 4, generator=gen), "step": step}
    with CheckpointManager(str(directory.parent / "durable"), cfg, run_id=RUN) as mgr:
        mgr.save(step, state, durable=False)
        mgr.before_optimizer_step()
        mgr.wait_until_finished()


class _Receiver:
    def __init__(self, root: Path) -> None:
        self.tier = root / "receiver"
        self.tier.mkdir()
        self.stats = ReplicaStats()
        self.holdings = ReplicaHoldings(self.tier / "replicas", RUN)
        self.server = ReplicaServer(self.holdings, str(self.tier), self.stats, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.port}"


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[_Receiver]:
    made = _Receiver(tmp_path)
    yield made
    made.server.close()


def test_a_large_snapshot_is_striped_over_the_senders_connections_and_held_byte_exact(
    tmp_path: Path, receiver: _Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tmp_path / "sender"
    _snapshot(tier, 7)
    parts: list[int] = []
    real = StripeBoard.receive_part

    def counting(
        self: StripeBoard, conn: socket.socket, session: str, seq: int, index: int
    ) -> None:
        parts.append(index)
        real(self, conn, session, seq, index)

    monkeypatch.setattr(StripeBoard, "receive_part", counting)
    stats = ReplicaStats()
    sender = ReplicaSender(str(tier), RUN, node=0, stats=stats, streams=4)
    try:
        sender.set_ring(Ring(round=1, target=receiver.address, ranks=(0,)))
        wait_for(lambda: stats.lag_steps() == 0 and stats.sent_bytes > 0, 30, "the ack of step 7")
    finally:
        sender.close()
    held = receiver.holdings.held(0)
    assert [h.meta.step for h in held] == [7]
    assert sorted(parts) == [1, 2, 3]  # stripe 0 rode on the put's own connection
    # Byte exact: the held payload equals the sender's slot, and its checksum verifies.
    local = SlotFiles(str(tier), 0)
    metas = {k: m for k, m in local.read_metas().items() if isinstance(m, dict)}
    ((slot, raw),) = metas.items()
    size = raw["payload_bytes"]
    assert size >= _STATE_BYTES
    sent = Path(local.payload_path(slot)).read_bytes()[:size]
    files = receiver.holdings.files(0)
    assert Path(files.payload_path(held[0].slot)).read_bytes()[:size] == sent
    assert verify_slot(files.payload_path(held[0].slot), held[0].meta) is None
    assert stats.sent_bytes == receiver.stats.received_bytes == size


def _raw_put(address: str, tier: Path, stripes: int) -> tuple[socket.socket, dict[str, Any], bytes]:
    """A put of the newest snapshot in `tier` proposing `stripes`: the socket after the
    go-ahead, the go-ahead, the payload."""
    files = SlotFiles(str(tier), 0)
    ((slot, raw),) = ((k, m) for k, m in files.read_metas().items() if isinstance(m, dict))
    payload = Path(files.payload_path(slot)).read_bytes()[: raw["payload_bytes"]]
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=20)
    request = {"op": "put", "run_id": RUN, "round": 1, "node": 0}
    meta = Path(files.meta_path(slot)).read_bytes()
    send_meta(sock, {**request, "stripes": stripes, "session": "s1", "seq": 1}, meta)
    reply = recv_frame(sock)
    assert reply is not None
    assert reply["ok"] is True, reply
    return sock, reply, payload


def test_a_stripe_cut_short_fails_its_put_and_the_next_put_is_held(
    tmp_path: Path, receiver: _Receiver
) -> None:
    tier = tmp_path / "sender"
    _snapshot(tier, 3)
    sock, reply, payload = _raw_put(receiver.address, tier, stripes=2)
    ranges = stripe_ranges(len(payload), reply["stripes"])
    assert len(ranges) == 2
    (_, first), (second_at, second) = ranges
    host, port = receiver.address.rsplit(":", 1)
    with sock:
        with socket.create_connection((host, int(port)), timeout=20) as part:
            send_frame(part, {"op": "part", "session": "s1", "seq": 1, "index": 1})
            part.sendall(payload[second_at : second_at + second // 2])
        # The broken stripe fails the put: its own connection is closed, nothing is held.
        sock.sendall(payload[:first])
        with pytest.raises((ProtocolError, OSError)):
            recv_exact(sock, 1)
    assert receiver.holdings.held(0) == []
    assert receiver.server.port  # still serving

    # A part for no open put closes its connection only.
    with socket.create_connection((host, int(port)), timeout=20) as stray:
        send_frame(stray, {"op": "part", "session": "nope", "seq": 9, "index": 1})
        assert stray.recv(1) == b""

    # The slot was released: the same snapshot, whole and on one connection, is held.
    sock, reply, payload = _raw_put(receiver.address, tier, stripes=1)
    with sock:
        assert reply.get("stripes", 1) == 1
        sock.sendall(payload)
        assert recv_frame(sock) == {"received": len(payload)}
        sock.sendall(b"C")
        assert recv_frame(sock) == {"ok": True}
    assert [h.meta.step for h in receiver.holdings.held(0)] == [3]


def _answer_one_put(
    listener: socket.socket, answer: Callable[[socket.socket, dict[str, Any]], None]
) -> threading.Thread:
    """A receiver that is not ours: accepts connections until one carries a `put`, lets
    `answer` handle it (its meta parsed into `request["meta"]`), then closes them all (extra
    connections never hear from it)."""

    def run() -> None:
        conns = []
        try:
            while True:
                conn, _ = listener.accept()
                conns.append(conn)
                request = recv_frame(conn)
                if request is not None and request.get("op") == "put":
                    answer(conn, {**request, "meta": json.loads(recv_meta(conn, request))})
                    return
        except OSError:
            pass  # the test closed the listener
        finally:
            for conn in conns:
                conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _snapshot_and_peer(tmp_path: Path, step: int) -> tuple[Path, socket.socket]:
    """A tier holding a snapshot of `step`, and a listening socket for a peer not ours."""
    tier = tmp_path / "sender"
    _snapshot(tier, step)
    return tier, socket.create_server(("127.0.0.1", 0))


def _send_to(tier: Path, listener: socket.socket, done: Callable[[ReplicaStats], bool]) -> None:
    """Run a 4-connection sender of `tier`'s snapshots at `listener` until `done(stats)`."""
    stats = ReplicaStats()
    sender = ReplicaSender(str(tier), RUN, node=0, stats=stats, streams=4)
    try:
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        sender.set_ring(Ring(round=1, target=target, ranks=(0,)))
        wait_for(lambda: done(stats), 30, "the sender's outcome")
        assert sender._thread.is_alive()  # whatever happened, it keeps sending
    finally:
        sender.close()
        listener.close()


def test_a_receiver_that_takes_no_stripes_gets_the_payload_on_one_connection(
    tmp_path: Path,
) -> None:
    # A receiver that takes no stripes answers the go-ahead without `stripes`.
    tier, listener = _snapshot_and_peer(tmp_path, step=5)
    got: dict[str, Any] = {}

    def old_protocol(conn: socket.socket, request: dict[str, Any]) -> None:
        send_frame(conn, {"ok": True})
        got["payload"] = recv_exact(conn, request["meta"]["payload_bytes"])
        send_frame(conn, {"received": len(got["payload"])})
        got["trailer"] = recv_exact(conn, 1)
        send_frame(conn, {"ok": True})

    thread = _answer_one_put(listener, old_protocol)
    _send_to(tier, listener, lambda stats: stats.sent_bytes > 0)
    thread.join(10)
    files = SlotFiles(str(tier), 0)
    ((slot, raw),) = ((k, m) for k, m in files.read_metas().items() if isinstance(m, dict))
    assert got.get("trailer") == b"C"
    assert got["payload"] == Path(files.payload_path(slot)).read_bytes()[: raw["payload_bytes"]]


def test_a_go_ahead_with_a_bad_stripe_count_is_a_failed_send_not_a_dead_sender(
    tmp_path: Path,
) -> None:
    tier, listener = _snapshot_and_peer(tmp_path, step=2)

    def bad_count(conn: socket.socket, request: dict[str, Any]) -> None:
        send_frame(conn, {"ok": True, "stripes": "many"})

    _answer_one_put(listener, bad_count)
    _send_to(tier, listener, lambda stats: stats.failures["connection"] >= 1)
