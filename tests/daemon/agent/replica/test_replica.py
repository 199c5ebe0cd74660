"""Peer replicas on real sockets (127.0.0.1): the ring's stream, the fetch, every refusal.

Snapshots are made by a real single-rank `CheckpointManager` with the memory tier on, so the
metas and payloads are exactly what ranks write.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckpt_manager import CheckpointConfig, CheckpointManager, MemoryTierConfig
from ckpt_manager.memory_slots import SlotFiles, restamp
from daemon.agent.replica import server as server_module
from daemon.agent.replica.fetch import fetch_missing, missing_ranks
from daemon.agent.replica.holdings import ReplicaHoldings
from daemon.agent.replica.peers import exchange
from daemon.agent.replica.protocol import Refusal, recv_frame, send_meta
from daemon.agent.replica.sender import ReplicaSender, Ring
from daemon.agent.replica.server import ReplicaServer
from daemon.agent.replica.stats import ReplicaStats
from daemon.metrics import REPLICA_FAILURE_REASONS
from tests.support.dist import free_port

pytestmark = pytest.mark.timeout(60)

RUN = "run-a"


def _snapshot(
    directory: Path, steps: list[int], run_id: str = RUN, *, kept_here: frozenset[int] = frozenset()
) -> dict[str, Any]:
    """Memory snapshots of rank 0 at `steps` in `directory` (those in `kept_here` saved with
    `replicate=False`); the last state saved."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = CheckpointConfig(memory=MemoryTierConfig(str(directory)))
    state: dict[str, Any] = {"w": torch.arange(4096, dtype=torch.float32), "step": 0}
    with CheckpointManager(str(directory.parent / "durable"), cfg, run_id=run_id) as mgr:
        for step in steps:
            state = {"w": state["w"] + 1, "step": step}
            mgr.save(step, state, durable=False, replicate=step not in kept_here)
            mgr.before_optimizer_step()
        mgr.wait_until_finished()
    return state


def _local_steps(directory: Path, rank: int = 0) -> list[int]:
    metas = SlotFiles(str(directory), rank).read_metas().values()
    return sorted(int(m["step"]) for m in metas if isinstance(m, dict))


def _one_snapshot(tier: Path) -> tuple[int, dict[str, Any], bytes]:
    """Rank 0's snapshot of step 1 in `tier`: its slot, meta and payload bytes."""
    _snapshot(tier, [1])
    slot, raw = _newest_meta(tier)
    return slot, raw, (tier / f"rank-00000.slot-{slot}").read_bytes()[: raw["payload_bytes"]]


def _newest_meta(directory: Path, rank: int = 0) -> tuple[int, dict[str, Any]]:
    metas = SlotFiles(str(directory), rank).read_metas()
    slot = max((k for k, m in metas.items() if isinstance(m, dict)), key=lambda k: metas[k]["step"])  # type: ignore[index]
    raw = metas[slot]
    assert isinstance(raw, dict)
    return slot, raw


class _Node:
    """One node's replica side: its tier directory, holdings and server."""

    def __init__(self, root: Path, name: str) -> None:
        self.tier = root / name
        self.tier.mkdir(parents=True)
        self.stats = ReplicaStats()
        self.holdings = ReplicaHoldings(self.tier / "replicas", RUN)
        self.server = ReplicaServer(self.holdings, str(self.tier), self.stats, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.port}"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[_Node]]:
    made = [_Node(tmp_path, "a"), _Node(tmp_path, "b")]
    yield made
    for node in made:
        node.server.close()


def _wait(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _put(address: str, request: dict[str, Any], payload: bytes | None = None) -> dict[str, Any]:
    """One `put` on a fresh connection: the first reply, or the final one if bytes were sent.
    `request["meta"]` (a JSON object) goes as its file's bytes would, after the frame."""
    host, port = address.rsplit(":", 1)
    frame = {k: v for k, v in request.items() if k != "meta"}
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        send_meta(sock, frame, json.dumps(request["meta"]).encode())
        reply = recv_frame(sock)
        assert reply is not None
        if reply.get("ok") is not True or payload is None:
            return reply
        sock.sendall(payload)
        assert recv_frame(sock) == {"received": len(payload)}
        sock.sendall(b"C")
        final = recv_frame(sock)
        assert final is not None
        return final


def test_ring_streams_the_newest_snapshot_and_a_fetch_restores_it_as_replica(
    tmp_path: Path, nodes: list[_Node]
) -> None:
    a, b = nodes
    state = _snapshot(a.tier, [1, 2, 3])
    sender = ReplicaSender(str(a.tier), RUN, node=0, stats=a.stats)
    try:
        sender.set_ring(Ring(round=4, target=b.address, ranks=(0,)))
        _wait(lambda: a.stats.lag_steps() == 0 and a.stats.sent_bytes > 0, "the ack of step 3")
    finally:
        sender.close()
    held = b.holdings.held(0)
    # Only the newest complete snapshot is streamed: older unsent ones are superseded.
    assert [h.meta.step for h in held] == [3]
    assert held[0].raw["replica_round"] == 4
    assert held[0].raw["replica_node"] == 0
    assert a.stats.sent_bytes == b.stats.received_bytes == held[0].meta.payload_bytes
    assert a.stats.values()["trainingd_memory_replica_send_seconds_total"][""] > 0

    # A replaced node: an empty tier directory. Its rank fetches from the peer holding it.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert missing_ranks(str(fresh), RUN, [0]) == [0]
    assert missing_ranks(str(a.tier), RUN, [0]) == []  # a survivor keeps its own slots
    stats = ReplicaStats()
    fetched = fetch_missing(
        str(fresh), run_id=RUN, ranks=[0], world_size=1, peers={1: b.address}, stats=stats,
        timeout_s=10,
    )  # fmt: skip
    assert fetched.steps == {0: [3]}, fetched.reasons
    cfg = CheckpointConfig(memory=MemoryTierConfig(str(fresh)))
    with CheckpointManager(str(tmp_path / "none"), cfg, run_id=RUN) as mgr:
        restored = mgr.restore()
    assert restored is not None
    assert (restored.step, restored.source) == (3, "replica")
    assert torch.equal(restored.state["w"], state["w"])


def test_a_snapshot_kept_on_its_node_is_passed_over_by_the_ring(
    tmp_path: Path, nodes: list[_Node]
) -> None:
    # [Note: under `auto` a durable save between two snapshots stays on its node]: step 2 is
    # saved with replicate=False; the sender streams step 1, the newest meant for the ring.
    a, b = nodes
    _snapshot(a.tier, [1, 2], kept_here=frozenset({2}))
    assert _newest_meta(a.tier)[1]["replicate"] is False
    sender = ReplicaSender(str(a.tier), RUN, node=0, stats=a.stats)
    try:
        sender.set_ring(Ring(round=1, target=b.address, ranks=(0,)))
        _wait(lambda: [h.meta.step for h in b.holdings.held(0)] == [1], "the replica of step 1")
        # The lag counts the snapshots meant for the ring: none is waiting.
        _wait(lambda: a.stats.lag_steps() == 0, "the ack of step 1")
        time.sleep(0.3)  # a sender that would stream step 2 has had its wake by now
    finally:
        sender.close()
    assert [h.meta.step for h in b.holdings.held(0)] == [1]
    assert a.stats.sent_bytes == b.stats.received_bytes == b.holdings.held(0)[0].meta.payload_bytes


def test_ranks_that_moved_between_nodes_come_back_from_slots_and_own_replicas(
    tmp_path: Path, nodes: list[_Node]
) -> None:
    # [Note: group ranks move between nodes]: the rendezvous orders nodes by host and pid, so
    # the fresh node that replaced node 1 may take group rank 0. Survivor `a` ran rank 0 and
    # held node 1's replica of rank 1; now it runs rank 1 and the fresh node `f` runs rank 0.
    a, f = nodes
    state = _snapshot(a.tier, [1, 2, 3])
    other = tmp_path / "node1-old"
    _snapshot(other, [5, 6])
    slot, raw = _newest_meta(other)
    replicas = a.tier / "replicas"
    (replicas / "rank-00001.slot-0").write_bytes((other / f"rank-00000.slot-{slot}").read_bytes())
    SlotFiles(str(replicas), 1).write_meta(0, restamp(raw, rank=1, replica_round=1, replica_node=1))

    # The survivor takes rank 1 from its own replicas; the fresh node takes rank 0 from the
    # survivor's own slots (no replica of rank 0 exists anywhere).
    got_a = fetch_missing(
        str(a.tier), run_id=RUN, ranks=[1], world_size=1, peers={0: f.address},
        stats=ReplicaStats(), timeout_s=10, own_replicas=str(replicas),
    )  # fmt: skip
    assert got_a.steps == {1: [6]}, got_a.reasons
    got_f = fetch_missing(
        str(f.tier), run_id=RUN, ranks=[0], world_size=1, peers={1: a.address},
        stats=ReplicaStats(), timeout_s=10, own_replicas=str(f.tier / "replicas"),
    )  # fmt: skip
    assert got_f.steps == {0: [2, 3]}, got_f.reasons
    cfg = CheckpointConfig(memory=MemoryTierConfig(str(f.tier)))
    with CheckpointManager(str(tmp_path / "none"), cfg, run_id=RUN) as mgr:
        restored = mgr.restore()
    assert restored is not None
    assert (restored.step, restored.source) == (3, "replica")
    assert torch.equal(restored.state["w"], state["w"])
    adopted = SlotFiles(str(a.tier), 1).read_metas()
    assert sorted(m["step"] for m in adopted.values() if isinstance(m, dict)) == [6]

    # The survivor's slots of its former rank 0 go once a rank of the new round snapshotted
    # (every peer fetched what it needed before any rank could).
    sender = ReplicaSender(str(a.tier), RUN, node=1, stats=ReplicaStats())
    try:
        sender.set_ring(Ring(round=2, target=None, ranks=(1,)), former=[0])
        time.sleep(0.3)
        assert SlotFiles(str(a.tier), 0).existing_slots() != []  # no new snapshot yet
        meta_slot, meta = _newest_meta(a.tier, rank=1)
        SlotFiles(str(a.tier), 1).write_meta(meta_slot, meta)  # rank 1 snapshots
        _wait(lambda: SlotFiles(str(a.tier), 0).existing_slots() == [], "former slots dropped")
    finally:
        sender.close()
    assert SlotFiles(str(a.tier), 0).read_metas() == {}
    assert SlotFiles(str(a.tier), 1).read_metas() != {}


def test_receiver_refuses_foreign_runs_stale_rounds_bad_checksums_and_a_full_tmpfs(
    tmp_path: Path, nodes: list[_Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = nodes
    _, raw, payload = _one_snapshot(a.tier)
    put = {"op": "put", "run_id": RUN, "node": 0}

    foreign = restamp(raw, run_id="run-b")
    reply = _put(b.address, {**put, "round": 1, "meta": foreign})
    assert reply["reason"] == "foreign_run", reply
    assert _put(b.address, {**put, "run_id": "run-b", "round": 1, "meta": raw})["ok"] is False

    assert _put(b.address, {**put, "round": 5, "meta": raw}, payload) == {"ok": True}
    reply = _put(b.address, {**put, "round": 4, "meta": raw})
    assert reply["reason"] == "stale_round", reply
    # Another sender's rounds are its own.
    assert _put(b.address, {**put, "node": 2, "round": 1, "meta": raw}, payload)["ok"] is True

    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 0xFF
    reply = _put(b.address, {**put, "round": 5, "meta": raw}, bytes(flipped))
    assert reply["reason"] == "checksum", reply
    assert [h.meta.step for h in b.holdings.held(0)] == [1]  # the good copy stays

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    reply = _put(b.address, {**put, "round": 5, "meta": raw})
    assert reply["reason"] == "no_space", reply
    assert "no room" in reply["detail"]
    monkeypatch.undo()

    failures = b.stats.values()["trainingd_memory_replica_failures_total"]
    assert set(failures) == set(REPLICA_FAILURE_REASONS) == {r.value for r in Refusal}
    assert failures["foreign_run"] == 2
    assert failures["stale_round"] == 1
    assert failures["checksum"] == 1
    assert failures["no_space"] == 1


def test_fetch_refuses_another_world_size(tmp_path: Path, nodes: list[_Node]) -> None:
    a, b = nodes
    _, raw, payload = _one_snapshot(a.tier)
    put = {"op": "put", "run_id": RUN, "node": 0, "round": 1, "meta": raw}
    assert _put(b.address, put, payload)["ok"] is True
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    stats = ReplicaStats()
    fetched = fetch_missing(
        str(fresh), run_id=RUN, ranks=[0], world_size=2, peers={1: b.address}, stats=stats,
        timeout_s=10,
    )  # fmt: skip
    assert fetched.steps == {}
    assert "world size 1, 2 now" in fetched.reasons[0]
    assert stats.failures["mismatch"] == 1
    assert missing_ranks(str(fresh), RUN, [0]) == [0]  # nothing was written


def test_peers_agree_on_a_growing_round_and_every_address() -> None:
    port = free_port()
    timeout = datetime.timedelta(seconds=20)
    host = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    for expected_round, prefix in ((1, "round-a"), (2, "round-b")):
        results: dict[int, Any] = {}

        def join(
            g: int, base: dist.Store, prefix: str = prefix, results: dict[int, Any] = results
        ) -> None:
            store = dist.PrefixStore(prefix, base)
            results[g] = exchange(
                store, run_id=RUN, group_rank=g, num_nodes=2, address=f"h{g}:{g}", timeout_s=10
            )

        threads = [threading.Thread(target=join, args=(g, s)) for g, s in ((0, host), (1, client))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert results[0] == results[1]
        assert results[0].round == expected_round
        assert results[0].addresses == {0: "h0:0", 1: "h1:1"}


def test_a_payload_cut_short_is_a_protocol_error_and_unmaps_the_slot(tmp_path: Path) -> None:
    # Seen in the 90 s store-pause drill: a sender that gave up mid-put (its receiver's daemon
    # was stopped) left the receiver's thread dying with `BufferError: cannot close exported
    # pointers exist` and a traceback on the daemon's stderr, instead of a refused put.
    from daemon.agent.replica.protocol import ProtocolError, recv_payload

    files = SlotFiles(str(tmp_path), 0)
    fd, capacity = files.allocate(0, 1 << 20)
    left, right = socket.socketpair()
    try:
        left.sendall(b"x" * 1000)
        left.close()
        with pytest.raises(ProtocolError, match="connection closed after 1000 of 1048576 bytes"):
            recv_payload(right, fd, capacity, 1 << 20)
    finally:
        os.close(fd)
        right.close()


def test_a_late_replica_still_shares_a_step_with_the_survivors_slots(
    tmp_path: Path, nodes: list[_Node]
) -> None:
    # [Note: a node keeps the step its peer's replica holds]: node b's rank 1 snapshots as fast
    # as survivor a's rank 0, but its replica of step 3 is the last one a holds when b is lost
    # (4, 5 and 6 were still on the wire). Without the kept step, rank 0's two slots had moved
    # on to 5 and 6 and no step was held by every rank (bench: kills 1 and 4 of
    # recovery_nodeloss_20261204_53c07b8 fell back to durable).
    a, b = nodes
    other = tmp_path / "node-b"
    _snapshot(other, [1, 2, 3])
    slot, raw = _newest_meta(other)
    payload = (other / f"rank-00000.slot-{slot}").read_bytes()[: raw["payload_bytes"]]

    cfg = CheckpointConfig(memory=MemoryTierConfig(str(a.tier)))
    state: dict[str, Any] = {"w": torch.zeros(4096), "step": 0}
    with CheckpointManager(str(tmp_path / "durable"), cfg, run_id=RUN) as mgr:
        for step in range(1, 7):
            state = {"w": state["w"] + 1, "step": step}
            mgr.save(step, state, durable=False)
            mgr.before_optimizer_step()
            mgr.wait_until_finished()
            if step == 3:  # rank 1's replica of step 3 lands on a
                put = {"op": "put", "run_id": RUN, "node": 1, "round": 1}
                meta = restamp(raw, rank=1)
                assert _put(a.address, {**put, "meta": meta}, payload) == {"ok": True}
    held = _local_steps(a.tier)
    assert held[-1] == 6
    assert 3 in held, held  # the step rank 1's replica holds

    # b is lost; its replacement fetches rank 1 from a: the replica's step is one rank 0 holds.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    fetched = fetch_missing(
        str(fresh), run_id=RUN, ranks=[1], world_size=1, peers={0: a.address},
        stats=ReplicaStats(), timeout_s=10,
    )  # fmt: skip
    assert fetched.steps == {1: [3]}, fetched.reasons

    # The next replica moves the kept step on; rank 0's next snapshots free the old slot.
    _snapshot(other, [7])
    slot, raw = _newest_meta(other)
    payload = (other / f"rank-00000.slot-{slot}").read_bytes()[: raw["payload_bytes"]]
    put = {"op": "put", "run_id": RUN, "node": 1, "round": 1, "meta": restamp(raw, rank=1)}
    assert _put(a.address, put, payload) == {"ok": True}
    assert b.holdings.held(1) == []  # only a received rank 1's replicas
    with CheckpointManager(str(tmp_path / "durable"), cfg, run_id=RUN) as mgr:
        assert mgr.restore() is not None  # keeps the slots up to step 6
        for step in (7, 8):
            mgr.save(step, {"w": state["w"] + step, "step": step}, durable=False)
            mgr.before_optimizer_step()
            mgr.wait_until_finished()
    held = _local_steps(a.tier)
    # Step 3's slot was taken again (an extra slot, filled while 3 was kept, keeps its step 5
    # until a snapshot needs it: as after a durable write pinned a slot).
    assert 3 not in held
    assert held[-2:] == [7, 8]


def test_a_slot_reused_before_the_receiver_read_its_bytes_is_superseded_not_torn(
    tmp_path: Path, nodes: list[_Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    # [Note: a sent page is read when the peer reads it] The receiver gives the go-ahead, then
    # reads nothing until the sender's trailer is there (or a second passed); meanwhile the rank
    # reuses the slot, as it does two snapshots later: the bytes still in the socket's buffers
    # are the file's pages, so they change too.
    a, b = nodes
    slot, _, payload = _one_snapshot(a.tier)
    nbytes = len(payload)
    receive = server_module.recv_payload

    def reused_before_read(sock: socket.socket, *args: Any, **kwargs: Any) -> bytes:
        ready = kwargs.pop("ready")
        ready()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            queued = int.from_bytes(fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4), "little")
            if queued > nbytes:  # the trailer came before any receipt
                break
            time.sleep(0.01)
        files = SlotFiles(str(a.tier), 0)
        files.remove_meta(slot)
        with open(files.payload_path(slot), "r+b") as f:
            f.write(b"\xa5" * nbytes)
        return receive(sock, *args, **kwargs)

    monkeypatch.setattr(server_module, "recv_payload", reused_before_read)
    sender = ReplicaSender(str(a.tier), RUN, node=0, stats=a.stats)
    try:
        sender.set_ring(Ring(round=1, target=b.address, ranks=(0,)))
        _wait(lambda: b.stats.received_bytes > 0, "the put's bytes")
    finally:
        sender.close()  # after the put's last reply, which follows any refusal's count
    assert b.stats.failures["checksum"] == 0, b.stats.failures
    assert b.holdings.held(0) == []  # superseded: nothing held, nothing refused
