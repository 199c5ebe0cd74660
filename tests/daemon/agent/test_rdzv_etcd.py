"""`rdzv_backend = "etcd-v2"`: a rendezvous in an etcd server outlives any node, node 0 included.

The configuration's part runs in process; the end-to-end test runs two single-rank daemons of a
`1:2` job on 127.0.0.1 against an etcd server the test starts on loopback
(`tests/support/etcd.py`), and holds the ranks at known steps with the gated job
(`tests/daemon/_gated_job.py`), so every step below is exact whatever the machine's speed.
"""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon._config_load import load_config
from daemon.agent import preflight
from daemon.config import LaunchSettings, RdzvBackend
from daemon.errors import ConfigError, StartupCheckError
from tests.daemon._daemon_proc import (
    GATED_JOB,
    DaemonProc,
    Gate,
    committed_steps,
    session_pids,
    wait_for,
)
from tests.support.etcd import EtcdServer

_BATCH_SIZE = 4
_MAX_STEPS = 16


def test_the_backend_is_c10d_by_default_and_etcd_v2_needs_the_servers_endpoint() -> None:
    assert LaunchSettings().rdzv_backend is RdzvBackend.C10D
    cfg = load_config({"rdzv_backend": "etcd-v2", "rdzv_endpoint": "etcd:2379"}, env={})
    assert cfg.launch.rdzv_backend is RdzvBackend.ETCD_V2
    with pytest.raises(ConfigError, match=r"rdzv_endpoint is empty: rdzv_backend=etcd-v2"):
        load_config({"rdzv_backend": "etcd-v2"}, env={})
    with pytest.raises(ConfigError, match=r"rdzv_backend=.zookeeper.*use one of c10d, etcd-v2"):
        load_config({}, env={"TRAININGD_RDZV_BACKEND": "zookeeper"})


def test_etcd_v2_without_python_etcd_is_a_one_line_startup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = load_config({"rdzv_backend": "etcd-v2", "rdzv_endpoint": "etcd:2379"}, env={})
    preflight._check_rendezvous(cfg)  # installed here (the test extra)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "etcd" else real(name, *a)
    )
    with pytest.raises(StartupCheckError, match=r"needs the python-etcd package") as err:
        preflight._check_rendezvous(cfg)
    assert "\n" not in str(err.value)
    preflight._check_rendezvous(load_config({}, env={}))  # c10d needs nothing


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd server (v2 API) on a free loopback port, data in the test's tmp folder."""
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()


def _node_args(endpoint: str, root: Path, node_rank: int) -> list[str]:
    return [
        "--nnodes", "1:2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", endpoint,
        "--rdzv-timeout-s", "120", "--rdzv-last-call-s", "3",
        "--max-steps", str(_MAX_STEPS), "--ckpt-uri", str(root), "--ckpt-every", "4",
        "--batch-size", str(_BATCH_SIZE), "--strategy", "optim_grads_params", *GATED_JOB,
        # Held ranks make no progress: the hang detector must not restart them meanwhile.
        "--hang-timeout-s", "600",
        # Each save commits before the next step: the held ranks find the steps they saved
        # committed. An async save still being written when the next one is due is deferred
        # ([Note: a durable save never stalls the loop]) and commits only at a later step,
        # which held ranks never reach: under load step 4's write outlasted 4 short steps and
        # a CI run found no committed step at the hold.
        "--async-mode", "sync",
    ]  # fmt: skip


def _rounds(node: DaemonProc) -> list[tuple[int, int]]:
    """(world size, start step) of every group this node's ranks trained in."""
    return [(int(e["world_size"]), int(e["start_step"])) for e in node.find("training")]


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(300)
def test_an_elastic_job_outlives_node_0_and_takes_it_back_with_an_etcd_rendezvous(
    tmp_path: Path, procs: list[DaemonProc], etcd: EtcdServer
) -> None:
    root = tmp_path / "ckpt"
    # Generation 0: both ranks (world 2) held after step 8, when steps 4 and 8 are committed
    # (synchronous saves). Generation 1: node 1 alone after its restart, held
    # 2 steps on: at world size 1 a step reads 2 micro-batches (the global batch stays) and a
    # restoring rank first reads 2 samples for its optimizer state.
    gate = Gate(
        tmp_path / "gate",
        after_steps=8,
        batch_size=_BATCH_SIZE,
        later_samples=(2 + 2 * 2 * _BATCH_SIZE,),
        hold_restarts=True,
    )
    # Either order joins both into the first round: the store is etcd's, not node 0's.
    node0 = DaemonProc(tmp_path, _node_args(etcd.endpoint, root, 0), gate.env, "node0")
    procs.append(node0)
    node1 = DaemonProc(tmp_path, _node_args(etcd.endpoint, root, 1), gate.env, "node1")
    procs.append(node1)
    gate.wait_until_held(2, node0, node1, timeout_s=120)
    newest = committed_steps(root)[-1]
    assert newest == 8

    # Node 0 dies. With c10d it took the rendezvous with it; here node 1's rank fails in its
    # next collective, the agent restarts it into a new rendezvous in etcd, which forms without
    # node 0 once its heartbeats stop, and node 1 goes on alone from the newest checkpoint.
    node0.signal(signal.SIGKILL)
    node0.wait(10)
    wait_for(lambda: not session_pids(node0.pid), 30, "node 0's ranks to follow their daemon")
    gate.open()
    gate.wait_until_held(1, node1, timeout_s=120, generation=1)
    assert _rounds(node1) == [(2, 0), (1, newest)], node1.logs()

    # Node 0 comes back and waits in the rendezvous; node 1's rank saves and stops after the
    # next step, and both go on at world size 2 to the end.
    back = DaemonProc(tmp_path, _node_args(etcd.endpoint, root, 0), gate.env, "node0-back")
    procs.append(back)
    wait_for(lambda: node1.find("membership_change_requested"), 90, "node 1 to see node 0")
    gate.open(1)
    assert node1.wait(150) == 0, node1.logs()
    assert back.wait(150) == 0, back.logs()

    rejoined = newest + 3
    assert _rounds(node1) == [(2, 0), (1, newest), (2, rejoined)], node1.logs()
    assert [int(e["ckpt_step"]) for e in node1.find("restored")] == [newest, rejoined]
    assert _rounds(back) == [(2, rejoined)], back.logs()
    assert committed_steps(root)[-1] == _MAX_STEPS
    assert session_pids(node1.pid) == []
    assert session_pids(back.pid) == []
