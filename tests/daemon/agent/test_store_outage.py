"""A rendezvous-store outage is ridden out within `rdzv_store_grace_s`; a lost host ends in 75.

`StoreGuard` is checked in process with a fake store and clock; the end-to-end tests run two
single-rank daemons of a fixed `--nnodes 2` job on 127.0.0.1 (c10d: node 0's daemon hosts the
store) with a short store timeout, and hold the ranks at a known step with the gated job, so
every step is exact whatever the machine's speed.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from daemon.agent.run import EXIT_PEER_STOPPED
from daemon.agent.store_guard import StoreGuard, StoreLostError
from daemon.observe.incidents import IncidentKind, IncidentLog, IncidentState
from tests.daemon._daemon_proc import (
    GATED_JOB,
    DaemonProc,
    Gate,
    committed_steps,
    session_pids,
    wait_for,
)
from tests.support.dist import free_port

_BATCH_SIZE = 4
_MAX_STEPS = 8
_STORE_TIMEOUT_S = 3
"""torch's store timeout in these tests (60 s by default): a paused store is noticed quickly."""


class _Store:
    """The part of a rendezvous handler `StoreGuard` asks, failing on demand."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.waiting = 0

    def num_nodes_waiting(self) -> int:
        if self.error is not None:
            raise self.error
        return self.waiting


def test_an_outage_answers_nobody_waits_until_the_grace_is_spent() -> None:
    now = [0.0]
    inner = _Store()
    guard = StoreGuard(inner, endpoint="node0:29400", grace_s=120, clock=lambda: now[0])  # type: ignore[arg-type]
    inner.waiting = 1
    assert guard.num_nodes_waiting() == 1
    timeout = RendezvousConnectionError("The connection to the C10d store has failed.")
    timeout.__cause__ = DistStoreError("wait timeout after 60000ms, keys: /torch.rdzv\nmore")
    inner.error = timeout
    for t in (0.0, 60.0, 119.0):  # the agent keeps its ranks: nobody waits
        now[0] = t
        assert guard.num_nodes_waiting() == 0
    assert guard.outage_s == 119.0
    inner.error = None  # the store answers again: the outage is over, and counts once
    assert guard.num_nodes_waiting() == 1
    assert (guard.outage_s, guard.num_outages) == (0.0, 1)

    inner.error = DistStoreError("Connection reset by peer")
    now[0] = 200.0
    assert guard.num_nodes_waiting() == 0  # a new outage starts its own grace
    now[0] = 320.5
    with pytest.raises(StoreLostError, match=r"node0:29400 did not answer for 120 s") as err:
        guard.num_nodes_waiting()
    assert "\n" not in str(err.value)
    assert guard.num_outages == 2
    inner.error = None  # lost is final: the agent ends, nothing closes the rendezvous
    with pytest.raises(StoreLostError):
        guard.num_nodes_waiting()
    assert guard.shutdown() is False


def test_each_outage_is_one_incident_recovered_or_left_open_for_the_daemon() -> None:
    now = [0.0]
    inner = _Store()
    incidents = IncidentLog(node=1)
    guard = StoreGuard(
        inner,  # type: ignore[arg-type]
        endpoint="node0:29400",
        grace_s=120,
        clock=lambda: now[0],
        incidents=incidents,
    )
    inner.error = DistStoreError("Connection reset by peer")
    for t in (0.0, 30.0):
        now[0] = t
        guard.num_nodes_waiting()
    (opened,) = incidents.recent()
    assert (opened.kind, opened.ranks, opened.node) == (IncidentKind.STORE_OUTAGE, (), 1)
    assert opened.cause == (
        "rendezvous store at node0:29400 unreachable: DistStoreError: Connection reset by peer"
    )
    inner.error = None
    guard.num_nodes_waiting()
    assert incidents.recent()[0].state is IncidentState.RECOVERED
    # A second outage past the grace: its incident stays open; the daemon ends it as fatal.
    inner.error = DistStoreError("Connection refused")
    now[0] = 100.0
    guard.num_nodes_waiting()
    now[0] = 221.0
    with pytest.raises(StoreLostError):
        guard.num_nodes_waiting()
    assert [i.state for i in incidents.recent()] == [IncidentState.OPEN, IncidentState.RECOVERED]
    assert incidents.is_open(IncidentKind.STORE_OUTAGE)
    assert incidents.counts()["store_outage"] == 2.0


def test_other_errors_pass_through() -> None:
    inner = _Store()
    guard = StoreGuard(inner, endpoint="node0:29400", grace_s=120)  # type: ignore[arg-type]
    inner.error = ValueError("not a store error")
    with pytest.raises(ValueError, match="not a store error"):
        guard.num_nodes_waiting()
    assert guard.num_outages == 0


def test_a_call_stuck_in_a_paused_store_is_given_up_after_the_grace() -> None:
    # A c10d client whose server is SIGSTOPped blocks until the server runs again.
    release = threading.Event()

    class _Paused:
        def num_nodes_waiting(self) -> int:
            release.wait(30)
            raise DistStoreError("wait timeout after 60000ms")

    guard = StoreGuard(_Paused(), endpoint="node0:29400", grace_s=0.5)  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(StoreLostError, match=r"did not answer for \d+ s"):
        guard.num_nodes_waiting()
    assert time.monotonic() - started < 10  # not the 30 s the call would take
    release.set()


def _node_args(endpoint: str, root: Path, node_rank: int, *extra: str) -> list[str]:
    return [
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
        "--rdzv-endpoint", endpoint, "--rdzv-timeout-s", "120",
        "--rdzv-store-timeout-s", str(_STORE_TIMEOUT_S),
        "--max-steps", str(_MAX_STEPS), "--ckpt-uri", str(root), "--ckpt-every", "2",
        "--batch-size", str(_BATCH_SIZE), "--strategy", "no_shard", *GATED_JOB, *extra,
        # The held ranks make no progress: the hang detector must not restart them meanwhile.
        "--hang-timeout-s", "600",
    ]  # fmt: skip


def _two_held_nodes(
    tmp_path: Path, procs: list[DaemonProc], gate: Gate, *extra: str
) -> tuple[DaemonProc, DaemonProc]:
    endpoint = f"127.0.0.1:{free_port()}"
    root = tmp_path / "ckpt"
    node1 = DaemonProc(tmp_path, _node_args(endpoint, root, 1, *extra), gate.env, "node1")
    procs.append(node1)
    node0 = DaemonProc(tmp_path, _node_args(endpoint, root, 0, *extra), gate.env, "node0")
    procs.append(node0)
    gate.wait_until_held(2, node0, node1, timeout_s=120)
    return node0, node1


def _state(pid: int) -> str:
    """A process's state letter (`T`: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _stderr_lines(node: DaemonProc) -> list[str]:
    return node.stderr_path.read_text(errors="replace").splitlines()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_paused_store_host_is_ridden_out_and_both_nodes_finish(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    gate = Gate(tmp_path / "gate", after_steps=3, batch_size=_BATCH_SIZE)
    node0, node1 = _two_held_nodes(tmp_path, procs, gate, "--rdzv-store-grace-s", "120")
    node0.signal(signal.SIGSTOP)  # node 0's daemon hosts the store; its ranks go on
    paused = time.monotonic()
    try:
        # Node 1's store calls block (a paused c10d server's clients wait for it) while both
        # ranks stay alive and held; the pause lasts several store timeouts (a
        # minimum: how much longer does not matter).
        wait_for(lambda: time.monotonic() - paused > 3 * _STORE_TIMEOUT_S, 60, "a long pause")
        assert _state(node0.pid) == "T", "node 0's daemon was continued during the pause"
        assert node1.exit_code() is None, node1.logs()
    finally:
        node0.signal(signal.SIGCONT)
    # A wait-list read in flight when the server stopped fails once it runs again (an outage,
    # ridden out); when the call caught by the pause was another (seen: none failed, and no
    # outage was logged) it simply completes. Either way node 1 keeps its ranks, and once
    # node 0 answers again any outage is over.
    wait_for(
        lambda: (
            len(node1.find("rendezvous_store_back"))
            == len(node1.find("rendezvous_store_unreachable"))
        ),
        60,
        "node 1 to reach the store again",
    )
    for outage in node1.find("rendezvous_store_unreachable"):
        assert outage["grace_s"] == 120
    # Each outage ridden out is one incident, recovered (no steps lost: nothing restarted).
    closed = [(e["kind"], e["state"]) for e in node1.find("incident_closed")]
    assert closed == [("store_outage", "recovered")] * len(node1.find("rendezvous_store_back"))
    gate.open()
    assert node1.wait(120) == 0, node1.logs()
    assert node0.wait(120) == 0, node0.logs()
    assert committed_steps(tmp_path / "ckpt")[-1] == _MAX_STEPS
    for back in node1.find("rendezvous_store_back"):  # the call waited out the whole pause
        assert float(back["outage_s"]) >= 2 * _STORE_TIMEOUT_S
    # One outage, one round: no restart of either node's ranks.
    assert len(node1.find("training")) == 1, node1.logs()
    assert not [line for line in _stderr_lines(node1) if line.startswith("Traceback")]
    assert session_pids(node0.pid) == []
    assert session_pids(node1.pid) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_store_host_ends_the_other_node_with_75_and_one_line(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    grace_s = 60
    gate = Gate(tmp_path / "gate", after_steps=3, batch_size=_BATCH_SIZE)
    node0, node1 = _two_held_nodes(tmp_path, procs, gate, "--rdzv-store-grace-s", str(grace_s))
    node0.signal(signal.SIGKILL)  # node 0 and the store it hosts are gone; its ranks follow
    node0.wait(10)
    wait_for(lambda: not session_pids(node0.pid), 30, "node 0's ranks to follow their daemon")
    gate.open()
    assert node1.wait(grace_s + 30) == EXIT_PEER_STOPPED, node1.logs()
    lines = _stderr_lines(node1)
    assert lines[-1].startswith("trainingd: rendezvous at "), lines[-5:]
    assert "exit 75" in lines[-1]
    assert node1.find("rendezvous_lost"), node1.logs()
    lost_at = next(i for i, line in enumerate(lines) if '"rendezvous_lost"' in line)
    after = lines[lost_at:]
    assert not [line for line in after if line.startswith("Traceback")], after
    # What the daemon started follows it (a rank's or the fork server's parent watch).
    wait_for(lambda: not session_pids(node1.pid), 10, "node 1's processes to follow it")
