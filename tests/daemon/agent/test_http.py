"""The node's HTTP endpoints across lifecycle states, and the supervisor's phase logic."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.agent.http import MetricsServer, health
from daemon.agent.supervisor import derive_phase
from daemon.observe.collector import NodeCollector, SnapshotAggregator, make_registry
from daemon.observe.state import NodePhase, NodeState
from daemon.rank.telemetry import RankTelemetry
from daemon.rundir.snapshot import RankPhase, snapshot_path


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[MetricsServer, NodeState, list[float]]]:
    state = NodeState(local_ranks=1)
    beats: list[float] = []
    collector = NodeCollector(SnapshotAggregator(tmp_path, 1), state, {"version": "t"}, run_id="t")
    server = MetricsServer(
        make_registry(collector), state, lambda: beats, heartbeat_timeout_s=60, port=0
    ).start()
    yield server, state, beats
    server.close()


def test_endpoints_follow_the_lifecycle(node: tuple[MetricsServer, NodeState, list[float]]) -> None:
    server, state, beats = node
    assert server.host == "127.0.0.1"
    assert server.port > 0
    base = f"http://127.0.0.1:{server.port}"
    code, body = _get(base + "/readyz")
    assert code == 503
    assert json.loads(body)["state"] == "starting"
    assert _get(base + "/healthz")[0] == 200
    state.update(phase=NodePhase.TRAINING, step=4)
    code, body = _get(base + "/readyz")
    assert code == 200
    assert json.loads(body) == {"ready": True, "state": "training", "step": 4}
    beats.append(0.0)  # a rank whose loop last beat in 1970
    assert _get(base + "/healthz")[0] == 503
    beats.clear()
    assert state.request_stop()
    assert not state.request_stop()
    assert _get(base + "/readyz")[0] == 503
    state.update(phase=NodePhase.TRAINING)  # a late rank report does not undo draining
    assert state.status().phase is NodePhase.DRAINING
    code, text = _get(base + "/metrics")
    assert code == 200
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"trainingd_daemon_state", "trainingd_build_info", "process_cpu_seconds"} <= names
    assert _get(base + "/nope")[0] == 404
    code, page = _get(base + "/")
    assert code == 200
    assert 'fetch("/api/status"' in page
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # no CDN, nothing remote
    code, body = _get(base + "/api/status")
    assert code == 200
    assert "/metrics" in json.loads(body)["endpoints"]


def test_health_verdict_uses_supervisor_and_rank_heartbeats() -> None:
    clock = [1000.0]
    state = NodeState(local_ranks=1, clock=lambda: clock[0])
    ok, body = health(state, lambda: [995.0], 10.0, now=1001.0)
    assert ok
    assert body["oldest_rank_heartbeat_age_s"] == 6.0
    assert not health(state, lambda: [980.0], 10.0, now=1001.0)[0]
    assert not health(state, list, 10.0, now=1100.0)[0]  # supervisor loop stalled


def test_phase_is_derived_from_the_current_incarnation(tmp_path: Path) -> None:
    agg = SnapshotAggregator(tmp_path, 2)
    assert derive_phase(agg.refresh(), 2) == (NodePhase.RENDEZVOUS, None)
    tels = [RankTelemetry(snapshot_path(tmp_path, k), rank=k, world_size=2) for k in range(2)]
    tels[0].heartbeat(RankPhase.RESTORING)
    assert derive_phase(agg.refresh(), 2)[0] is NodePhase.LOADING
    for t in tels:
        t.set("trainingd_train_step", 3)
        t.heartbeat(RankPhase.TRAINING)
    assert derive_phase(agg.refresh(), 2) == (NodePhase.TRAINING, 3)
    tels[1].heartbeat(RankPhase.FINISHING)
    assert derive_phase(agg.refresh(), 2)[0] is NodePhase.CHECKPOINTING
