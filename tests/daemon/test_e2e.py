"""End to end: the real `trainingd` console script on 2 local ranks, observed from outside.

Each test starts `trainingd run` as a subprocess (own session, JSON logs, free metrics port) and
checks what an operator would: metrics during the run, exit codes, committed checkpoints
(`ckptctl`), the systemd notify stream, and that no process of the run survives.

No test may race the run to its end: a quick machine trains these small runs in about a second,
while `/metrics` lags up to `publish_interval_s` behind. A test that acts at a step of its
choosing holds the ranks there with the gated job (`Gate`, `tests/daemon/_gated_job.py`); one
that only needs the run to be alive gives it far more steps than it can reach and stops it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.daemon._daemon_proc import (
    GATED_JOB,
    TRAININGD,
    DaemonProc,
    Gate,
    ckptctl_list,
    ckptctl_restore,
    committed_steps,
    session_pids,
    wait_for,
)
from tests.support.dist import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Small, fast runs: 2 ranks x 1 thread; saves every 4 steps.
_BATCH_SIZE = 4
_FAST = [
    "--nproc-per-node", "2", "--ckpt-every", "4", "--warmup-steps", "2",
    "--batch-size", str(_BATCH_SIZE),
]  # fmt: skip
# More steps than any machine trains before the test stops the run itself.
_ENDLESS = "100000"

# Every name the daemon issue requires, and whether a short ZeRO-3 run with saves must have
# made it non-zero (gauges that are legitimately 0 at a random instant are only required).
_REQUIRED_NONZERO = {
    "trainingd_train_steps_total": "trainingd_train_steps_total",
    "trainingd_train_step": "trainingd_train_step",
    "trainingd_train_step_duration_seconds": "trainingd_train_step_duration_seconds_count",
    "trainingd_train_tokens_total": "trainingd_train_tokens_total",
    "trainingd_train_loss": "trainingd_train_loss",
    "trainingd_fsdp_queue_depth_step_peak": "trainingd_fsdp_queue_depth_step_peak",
    "trainingd_fsdp_queue_bound": "trainingd_fsdp_queue_bound",
    "trainingd_fsdp_queue_issue_depth": "trainingd_fsdp_queue_issue_depth_count",
    "trainingd_fsdp_prefetch_hits_total": "trainingd_fsdp_prefetch_hits_total",
    "trainingd_fsdp_collective_seconds": "trainingd_fsdp_collective_seconds_count",
    "trainingd_fsdp_collective_bytes_total": "trainingd_fsdp_collective_bytes_total",
    "trainingd_ckpt_save_stall_seconds": "trainingd_ckpt_save_stall_seconds_count",
    "trainingd_ckpt_save_latency_seconds": "trainingd_ckpt_save_latency_seconds_count",
    "trainingd_ckpt_write_seconds": "trainingd_ckpt_write_seconds_count",
    "trainingd_ckpt_finalize_seconds": "trainingd_ckpt_finalize_seconds_count",
    "trainingd_ckpt_bytes_total": "trainingd_ckpt_bytes_total",
    "trainingd_ckpt_saves_total": "trainingd_ckpt_saves_total",
    "trainingd_ckpt_last_committed_step": "trainingd_ckpt_last_committed_step",
    "trainingd_ckpt_last_committed_timestamp_seconds": (
        "trainingd_ckpt_last_committed_timestamp_seconds"
    ),
    "trainingd_rank_heartbeat_timestamp_seconds": "trainingd_rank_heartbeat_timestamp_seconds",
    "trainingd_build_info": "trainingd_build_info",
}
# Present, but 0 is a legitimate value: no save in flight at that instant; every unshard
# prefetched in time.
_REQUIRED_PRESENT = {"trainingd_ckpt_inflight", "trainingd_fsdp_prefetch_misses_total"}


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[list[str], str]]:
    """A datagram socket playing systemd: a thread reads it continuously (the kernel queues
    only a few datagrams), collecting every line."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(0.1)
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                lines.extend(sock.recv(4096).decode().splitlines())
            except TimeoutError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield lines, path
    done.set()
    reader.join(timeout=5)
    sock.close()


def _restore_all(root: Path, step: int, out: Path) -> dict[str, torch.Tensor]:
    ckptctl_restore(root, step, out)
    state = torch.load(out, weights_only=True)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", state)
    return flat


def test_trains_scrapes_notifies_and_stops_cleanly_on_sigterm(
    tmp_path: Path, procs: list[DaemonProc], notify_socket: tuple[list[str], str]
) -> None:
    messages, path = notify_socket
    root = tmp_path / "ckpt"
    args = [*_FAST, "--strategy", "optim_grads_params", "--max-steps", _ENDLESS]
    d = DaemonProc(
        tmp_path,
        [*args, "--ckpt-uri", str(root)],
        env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"},
    )
    procs.append(d)

    # Wait until work of every kind has been done and published: steps, and two commits (a job
    # value, exported once per node from local rank 0) and both ranks' heartbeats.
    def two_commits_and_both_ranks() -> bool:
        committed = d.values("trainingd_ckpt_saves_total", result="committed")
        beats = d.values("trainingd_rank_heartbeat_timestamp_seconds")
        return len(committed) == 1 and min(committed) >= 2 and len(beats) == 2

    wait_for(two_commits_and_both_ranks, 120, "2 commits and both ranks")
    samples = d.scrape()
    for name, sample in _REQUIRED_NONZERO.items():
        values = [v for _, v in samples.get(sample, [])]
        assert values, f"{name} missing from the scrape"
        assert max(values) > 0, f"{name} is zero after a ZeRO-3 run with saves"
    assert set(samples) >= _REQUIRED_PRESENT
    ranks = {labels["rank"] for labels, _ in samples["trainingd_rank_heartbeat_timestamp_seconds"]}
    assert ranks == {"0", "1"}
    (step_labels,) = [lab for lab, _ in samples["trainingd_train_step"]]
    assert set(step_labels) == {"run_id"}
    committed = [
        v for lab, v in samples["trainingd_ckpt_saves_total"] if lab["result"] == "committed"
    ]
    assert min(committed) >= 2
    assert d.get("/readyz")[0] == 200
    assert d.get("/healthz")[0] == 200

    d.signal(signal.SIGTERM)
    # 143 = 128 + SIGTERM: stopped on this node with a final checkpoint, not finished.
    assert d.wait(120) == 128 + signal.SIGTERM, d.logs()
    stops = d.find("stopping")
    assert stops, d.logs()
    # Each rank names the signal that stopped its daemon (it logged null before).
    assert {e["signal"] for e in stops} == {"SIGTERM"}, stops
    stop_step = int(stops[0]["step"])
    assert stop_step < int(_ENDLESS)
    assert committed_steps(root)[-1] == stop_step  # the final checkpoint, at the stop step
    # How it ended, as the operator reads it on stdout: stopped, not finished; no sample.
    out = d.stdout_path.read_text()
    assert f"stopped at step {stop_step} (checkpoint committed) on SIGTERM: " in out, out
    assert "finished" not in out
    assert "sample" not in out  # only a run that reached max_steps shows one
    ready = messages.index("READY=1")
    assert "WATCHDOG=1" in messages[ready + 1 :]
    assert "STOPPING=1" in messages[ready + 1 :]
    assert messages.index("STOPPING=1") > ready
    assert any(m.startswith("STATUS=") for m in messages)
    assert session_pids(d.pid) == []


def test_resume_after_sigterm_is_bitwise_exact(tmp_path: Path, procs: list[DaemonProc]) -> None:
    # ZeRO-3 here; the memory resume below is bitwise for no_shard (each strategy resumes
    # from one tier in the suite: the state dicts differ, the restore paths do not).
    strategy = "optim_grads_params"
    steps, held_after = 12, 3
    stopped_at = held_after + 1
    args = [
        *_FAST, *GATED_JOB, "--strategy", strategy, "--max-steps", str(steps), "--ckpt-every", "0",
    ]  # fmt: skip
    # The straight run shares nothing with the interrupted one (own root, run dir, ports): it
    # trains alongside it, mostly while the interrupted run's ranks wait at the gate.
    straight = DaemonProc(tmp_path, [*args, "--ckpt-uri", str(tmp_path / "a")], name="a")
    procs.append(straight)

    # The interrupted run is held after step 3; SIGTERM lands there, and only once the daemon
    # has written the stop request do the ranks go on: they agree to stop at step 4 exactly,
    # however fast or slow the machine.
    gate = Gate(tmp_path / "gate", after_steps=held_after, batch_size=_BATCH_SIZE)
    first = DaemonProc(tmp_path, [*args, "--ckpt-uri", str(tmp_path / "b")], gate.env, "b1")
    procs.append(first)
    gate.wait_until_held(2, first, timeout_s=120)
    first.signal(signal.SIGTERM)
    wait_for(lambda: first.find("stop_requested"), 30, "stop_requested")
    gate.open()
    assert first.wait(120) == 128 + signal.SIGTERM, first.logs()
    assert {int(e["step"]) for e in first.find("stopping")} == {stopped_at}, first.logs()
    assert committed_steps(tmp_path / "b") == [stopped_at]
    second = DaemonProc(tmp_path, [*args, "--ckpt-uri", str(tmp_path / "b")], name="b2")
    procs.append(second)
    assert second.wait(150) == 0, second.logs()
    assert int(second.find("restored")[0]["ckpt_step"]) == stopped_at
    assert straight.wait(150) == 0, straight.logs()

    a = _restore_all(tmp_path / "a", steps, tmp_path / "a.pt")
    b = _restore_all(tmp_path / "b", steps, tmp_path / "b.pt")
    model_keys = [k for k in a if k.startswith("/model/")]
    assert model_keys
    assert set(a) == set(b)
    for key in a:
        if key.startswith("/rng"):
            continue
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"


def test_killed_worker_resumes_from_memory_bitwise_and_daemon_death_leaves_nothing(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    root = tmp_path / "ckpt"
    # 24 steps: the restarted group trains on past the held step 10 and commits the last.
    # Durable saves every 5 steps, memory snapshots every step; the ranks publish often, so
    # that their first step after the restart is in a snapshot before they are held again.
    args = [
        *_FAST, *GATED_JOB, "--strategy", "no_shard", "--max-steps", "24",
        "--ckpt-every", "5", "--memory-every", "1", "--publish-interval-s", "0.05",
    ]  # fmt: skip
    # The uninterrupted run: same job and seeds, its own root and memory tier.
    straight = DaemonProc(tmp_path, [*args, "--ckpt-uri", str(tmp_path / "a")], name="a")
    procs.append(straight)
    # The first incarnation is held after step 10 until its rank is killed, so the run cannot
    # end first. Step 5 is durable by then; step 10's save may still be in flight. The
    # restarted group is held 10 steps after its restore (step 19 or 20), so that the
    # incident can be read from the live daemon, then let go.
    gate = Gate(tmp_path / "gate", after_steps=10, batch_size=_BATCH_SIZE, hold_restarts=True)
    d = DaemonProc(tmp_path, [*args, "--ckpt-uri", str(root)], gate.env)
    procs.append(d)
    gate.wait_until_held(2, d, timeout_s=120)
    victim = wait_for(d.rank_pids, 30, "rank processes")[0]
    os.kill(victim, signal.SIGKILL)
    # One story for the whole fault: which rank, how fast it was seen and recovered, how many
    # steps were redone, where the state came from (#30 item 4).
    incident = _recovered_incident(d)
    failed = d.find("rank_failed")
    assert [e["rank"] for e in failed] == incident["ranks"], d.logs()
    assert (incident["kind"], incident["node"], incident["source"]) == ("rank_failure", 0, "memory")
    assert incident["cause"] == f"rank {incident['ranks'][0]} (node 0): killed by SIGKILL"
    restored = d.find("restored")
    assert restored, d.logs()
    assert {e["source"] for e in restored} == {"memory"}, restored
    # At most one step lost at memory_every 1 (the copy of step 10 may not have finished).
    assert {int(e["ckpt_step"]) for e in restored} <= {9, 10}, restored
    assert {int(e["restart"]) for e in restored} == {1}
    assert incident["steps_lost"] == 10 - min(int(e["ckpt_step"]) for e in restored), incident
    assert 0 <= incident["detection_s"] <= 5, incident  # the supervisor's tick, the agent's poll
    assert 0 < incident["recovery_s"] < 120, incident
    closed = d.find("incident_closed")
    assert [(e["kind"], e["steps_lost"], e["source"]) for e in closed] == [
        ("rank_failure", incident["steps_lost"], "memory")
    ]
    # `trainingd status` prints it from the live daemon.
    command = [str(TRAININGD), "status", "--url", d.url]
    status = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    row = next(line.split() for line in status.stdout.splitlines() if "rank_failure" in line)
    assert row[:2] == [str(incident["id"]), "rank_failure"], status.stdout
    assert f"{incident['detection_s']:.1f}" in row, status.stdout
    assert f"{incident['recovery_s']:.1f}" in row, status.stdout
    # `#  what  rank R node 0  D s  R s  steps-lost  source  state  cause...`
    assert row[10:13] == [str(incident["steps_lost"]), "memory", "recovered"], status.stdout
    assert "phase training" in status.stdout or "phase loading" in status.stdout, status.stdout
    gate.open()
    assert d.wait(180) == 0, d.logs()
    assert committed_steps(root)[-1] == 24
    assert session_pids(d.pid) == []
    assert straight.wait(150) == 0, straight.logs()
    a = _restore_all(tmp_path / "a", 24, tmp_path / "a.pt")
    b = _restore_all(root, 24, tmp_path / "b.pt")
    assert set(a) == set(b)
    assert any(k.startswith("/model/") for k in a)
    for key in a:
        if not key.startswith("/rng"):
            assert torch.equal(a[key], b[key]), f"{key} differs after the memory resume"

    # Now the daemon itself dies, its ranks held after a save: ranks, writers and the rank
    # fork server must follow within 10 s.
    held = Gate(tmp_path / "gate-k", after_steps=4, batch_size=_BATCH_SIZE)
    again = DaemonProc(tmp_path, [*args, "--ckpt-uri", str(tmp_path / "k")], held.env, "k")
    procs.append(again)
    held.wait_until_held(2, again, timeout_s=120)
    server = again.fork_server_pid()
    running = session_pids(again.pid)
    assert server in running
    assert len(running) >= 4  # daemon + fork server + 2 ranks (+ writers)
    assert len(again.rank_pids()) == 2
    again.signal(signal.SIGKILL)
    again.wait(10)
    deadline = time.monotonic() + 10
    while session_pids(again.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_pids(again.pid) == [], "processes outlived the daemon by 10 s"


def _recovered_incident(d: DaemonProc) -> dict[str, Any]:
    """The newest incident on `/api/status` once it is recovered (the restart's first step)."""

    def recovered() -> dict[str, Any] | None:
        assert d.exit_code() is None, d.logs()
        _, body = d.get("/api/status")
        incidents = json.loads(body)["incidents"]
        return incidents[0] if incidents and incidents[0]["state"] == "recovered" else None

    found: dict[str, Any] = wait_for(recovered, 120, "a recovered incident on /api/status")
    return found


def _two_held_nodes(
    tmp_path: Path,
    procs: list[DaemonProc],
    root: Path,
    after_steps: int,
    *args: str,
    nproc: int = 1,
) -> tuple[list[DaemonProc], Gate]:
    """Two daemons of `nproc` ranks each, one 10-step job, all ranks held after `after_steps`."""
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-endpoint", endpoint,
        "--max-steps", "10", "--ckpt-uri", str(root), "--batch-size", str(_BATCH_SIZE),
        "--rdzv-timeout-s", "120", *args, *GATED_JOB,
    ]  # fmt: skip
    gate = Gate(tmp_path / "gate", after_steps=after_steps, batch_size=_BATCH_SIZE)
    nodes = [
        DaemonProc(tmp_path, [*common, "--node-rank", str(k)], gate.env, f"node{k}") for k in (0, 1)
    ]
    procs.extend(nodes)
    gate.wait_until_held(2 * nproc, *nodes, timeout_s=120)
    return nodes, gate


def test_two_daemons_train_one_job_and_each_serves_metrics(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    root = tmp_path / "ckpt"
    # Every rank is held after step 5 while the test reads each daemon's metrics. The default
    # strategy (ZeRO-3) on two nodes shards within each node and replicates across the nodes.
    nodes, gate = _two_held_nodes(tmp_path, procs, root, 5, "--ckpt-every", "5", nproc=2)
    for node in nodes:
        # The supervisor takes these from the ranks' snapshots on its next tick (0.25 s).
        wait_for(lambda n=node: n.max_value("trainingd_daemon_world_size") == 4, 30, "world")
        assert node.max_value("trainingd_daemon_local_ranks") == 2
    beats = "trainingd_rank_heartbeat_timestamp_seconds"
    ranks = {labels["rank"] for node in nodes for labels, _ in node.scrape()[beats]}
    assert ranks == {"0", "1", "2", "3"}
    gate.open()
    assert [node.wait(150) for node in nodes] == [0, 0], nodes[0].logs() + nodes[1].logs()
    layouts = {(e["world_size"], e["shard_group_size"]) for n in nodes for e in n.find("training")}
    assert layouts == {(4, 2)}, "hybrid default: sharded within each node of 2 ranks"
    rows = ckptctl_list(root)
    assert rows[-1]["step"] == 10
    assert {row["world_size"] for row in rows} == {4}


def test_a_stopped_node_exits_143_and_its_peer_asks_for_a_restart(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    # [Note: exit codes tell finished from stopped]: a drain of node 1 must not look like a
    # finished job on either node.
    root = tmp_path / "ckpt"
    nodes, gate = _two_held_nodes(tmp_path, procs, root, 3, "--ckpt-every", "0")
    nodes[1].signal(signal.SIGTERM)
    wait_for(lambda: nodes[1].find("stop_requested"), 30, "the stop request")
    gate.open()
    codes = [node.wait(150) for node in nodes]
    assert codes == [75, 128 + signal.SIGTERM], nodes[0].logs() + nodes[1].logs()
    assert committed_steps(root) == [4]  # the agreed final checkpoint, committed by both


def test_a_lost_node_resumes_from_its_peer_replica_without_reading_storage(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    # Two nodes of one rank, memory snapshots every step, no periodic durable checkpoint: only
    # node 0's replica of node 1's rank can bring step `held_after` back after node 1 is lost.
    root = tmp_path / "ckpt"
    held_after = 4
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
        "--max-steps", "8", "--ckpt-uri", str(root), "--batch-size", str(_BATCH_SIZE),
        "--rdzv-timeout-s", "120", "--strategy", "no_shard", "--memory-every", "1",
        "--ckpt-every", "0", "--memory-replica-address", "127.0.0.1:0", *GATED_JOB,
    ]  # fmt: skip
    gate = Gate(tmp_path / "gate", after_steps=held_after, batch_size=_BATCH_SIZE)
    nodes = [
        DaemonProc(tmp_path, [*common, "--node-rank", str(k)], gate.env, f"node{k}") for k in (0, 1)
    ]
    procs.extend(nodes)
    gate.wait_until_held(2, *nodes, timeout_s=120)
    # The rendezvous orders the daemons by pid, which a machine that wraps its pids can give
    # node 1 the lower one of: each node's rank is read, not assumed.
    (first_rank,) = {int(e["rank"]) for e in nodes[0].find("training")}
    peer_rank = 1 - first_rank
    # Node 0 holds node 1's rank's snapshot of the held step, complete (its meta is written
    # last).
    replicas = tmp_path / "node0-shm"

    def step_of(meta: Path) -> int | None:
        try:  # the receiver empties a slot's meta before it overwrites the slot
            return int(json.loads(meta.read_text())["step"])
        except FileNotFoundError:
            return None

    def replicated() -> bool:
        metas = replicas.glob(f"trainingd-*-0/replicas/rank-{peer_rank:05d}.slot-*.json")
        return any(step_of(p) == held_after for p in metas)

    wait_for(replicated, 60, f"node 0's replica of rank {peer_rank} at step {held_after}")

    # Node 1 is lost: its daemon, fork server and rank at once (and, as with its host, the
    # semaphores its daemon held in /dev/shm).
    nodes[1].cleanup()
    gate.open()  # node 0's rank goes on, fails in its next collective, and is restarted
    # A fresh daemon with an empty memory dir takes node rank 1.
    fresh = DaemonProc(tmp_path, [*common, "--node-rank", "1"], name="node1b")
    procs.append(fresh)
    codes = [nodes[0].wait(180), fresh.wait(180)]
    assert codes == [0, 0], nodes[0].logs() + fresh.logs()

    restored = fresh.find("restored")
    assert [(e["source"], int(e["ckpt_step"])) for e in restored] == [("replica", held_after)], (
        fresh.logs()
    )
    assert restored[0]["fallback_reason"] is None
    fetched = fresh.find("replica_fetched")
    assert fetched, fresh.logs()
    # The fresh node joined a job that had run a round: it did not check the root (nothing
    # read from storage before its rank trained); node 0 checked it in the job's first round.
    (skipped,) = fresh.find("root_checks_skipped")
    assert int(skipped["round"]) > 1
    assert not nodes[0].find("root_checks_skipped")
    # The new round gives the survivor and the fresh node either rank: the survivor restores
    # its own snapshot if it kept its rank, else the replica it holds of its peer's, and the
    # fresh node fetched the other rank's state, which holds the held step.
    survivor = [e for e in nodes[0].find("restored") if int(e["restart"]) >= 1]
    assert [(e["source"], int(e["ckpt_step"])) for e in survivor] == [
        ("memory" if int(survivor[0]["rank"]) == first_rank else "replica", held_after)
    ], nodes[0].logs()
    ((fresh_rank, steps),) = fetched[0]["steps"].items()
    assert int(fresh_rank) == 1 - int(survivor[0]["rank"]), fetched
    assert held_after in steps, fetched
    # Nothing durable existed to restore from: the only commit is the final step.
    assert committed_steps(root) == [8]
    # Every exit the daemons saw left their memory dirs empty.
    for name in ("node0-shm", "node1b-shm"):
        assert list((tmp_path / name).iterdir()) == [], name
