"""The hang ledger: what `/metrics` and the status board say about declared hangs."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.observe.collector import NodeCollector, SnapshotAggregator, make_registry
from daemon.observe.hangs import HangLedger, HangReport
from daemon.observe.state import NodePhase, NodeState
from daemon.observe.status import StatusBoard
from daemon.rank.telemetry import RankTelemetry
from daemon.rundir.snapshot import RankPhase, snapshot_path


def _report(rank: int, *, cause: bool, stopped: bool = False) -> HangReport:
    return HangReport(
        rank=rank,
        local_rank=rank,
        node=0,
        phase="backward" if cause else "collective",
        step=45,
        seconds_without_progress=3.2,
        stopped=stopped,
        waiting=not cause,
        cause=cause,
        frame=None if stopped else "/jobs/spin.py:12 in build",
        stacks=f"/run/stacks/rank-{rank}.txt",
        unix_s=1000.0,
    )


def _publish_two_ranks(run_dir: Path) -> None:
    for k in (0, 1):
        tel = RankTelemetry(snapshot_path(run_dir, k), rank=k, world_size=2)
        tel.heartbeat(RankPhase.TRAINING)


def _hang_samples(collector: NodeCollector) -> dict[tuple[str, str], float]:
    text = generate_latest(make_registry(collector, process_metrics=False)).decode()
    found = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("trainingd_rank_hung", "trainingd_rank_hangs_total"):
                found[(s.name, s.labels["rank"])] = s.value
    return found


def test_causes_count_and_stay_hung_until_they_recover_waiters_never_do() -> None:
    ledger = HangLedger()
    assert ledger.last() == []
    assert ledger.hung_ranks() == []
    ledger.declare([_report(1, cause=False), _report(0, cause=True, stopped=True)])
    assert ledger.hung_ranks() == [0]
    assert (ledger.num_hangs(0), ledger.num_hangs(1)) == (1, 0)
    assert [r.rank for r in ledger.last()] == [0, 1]  # the cause first
    ledger.recovered(0)
    assert not ledger.hung(0)
    ledger.declare([_report(0, cause=True)])
    assert ledger.num_hangs(0) == 2


def test_every_rank_exports_zero_from_the_start_and_the_hung_one_one(tmp_path: Path) -> None:
    _publish_two_ranks(tmp_path)
    ledger = HangLedger()
    state = NodeState(local_ranks=2)
    collector = NodeCollector(
        SnapshotAggregator(tmp_path, 2), state, {"version": "x"}, run_id="r", hangs=ledger
    )
    assert _hang_samples(collector) == {
        ("trainingd_rank_hung", "0"): 0.0,
        ("trainingd_rank_hung", "1"): 0.0,
        ("trainingd_rank_hangs_total", "0"): 0.0,
        ("trainingd_rank_hangs_total", "1"): 0.0,
    }
    ledger.declare([_report(1, cause=True), _report(0, cause=False)])
    after = _hang_samples(collector)
    assert after[("trainingd_rank_hung", "1")] == 1.0
    assert after[("trainingd_rank_hangs_total", "1")] == 1.0
    assert after[("trainingd_rank_hung", "0")] == 0.0
    assert after[("trainingd_rank_hangs_total", "0")] == 0.0
    ledger.recovered(1)
    assert _hang_samples(collector)[("trainingd_rank_hung", "1")] == 0.0
    assert _hang_samples(collector)[("trainingd_rank_hangs_total", "1")] == 1.0


def test_the_status_board_shows_hung_ranks_and_the_last_hang(tmp_path: Path) -> None:
    _publish_two_ranks(tmp_path)
    ledger = HangLedger()
    board = StatusBoard(max_steps=10, ckpt_uri="memory://x", list_checkpoints=list, hangs=ledger)
    state = NodeState(local_ranks=2)
    views = SnapshotAggregator(tmp_path, 2).refresh()
    board.observe(views, state.update(phase=NodePhase.TRAINING))
    empty = board.snapshot()
    assert empty["hangs"] == {"hung_ranks": [], "last": []}
    assert [r["hung"] for r in empty["ranks"]] == [False, False]
    ledger.declare([_report(0, cause=False), _report(1, cause=True, stopped=True)])
    board.observe(views, state.update(phase=NodePhase.TRAINING))
    shown = board.snapshot()
    assert [r["hung"] for r in shown["ranks"]] == [False, True]
    assert shown["hangs"]["hung_ranks"] == [1]
    last = shown["hangs"]["last"]
    roles = [(h["rank"], h["cause"], h["stopped"]) for h in last]
    assert roles == [(1, True, True), (0, False, False)]
    assert last[1]["frame"] == "/jobs/spin.py:12 in build"
    assert {"node", "phase", "step", "seconds_without_progress", "unix_s"} <= set(last[0])
