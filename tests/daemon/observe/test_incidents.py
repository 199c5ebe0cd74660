"""The incident record: arithmetic, states, the ring, the JSON-lines history, the ledgers' hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from daemon.metrics import INCIDENT_KINDS
from daemon.observe.hangs import HangLedger, HangReport
from daemon.observe.incidents import (
    INCIDENTS_FILE,
    Incident,
    IncidentKind,
    IncidentLog,
    IncidentState,
    read_incidents,
)
from daemon.observe.status import StatusBoard
from daemon.observe.stragglers import StragglerLedger, StragglerReport


class _Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_metric_label_values_are_the_kinds() -> None:
    assert tuple(k.value for k in IncidentKind) == INCIDENT_KINDS


def test_detection_recovery_and_steps_lost_of_a_recovered_incident(tmp_path: Path) -> None:
    clock = _Clock(1000.0)
    incidents = IncidentLog(node=1, path=tmp_path / INCIDENTS_FILE, clock=clock)
    opened = incidents.open(
        IncidentKind.RANK_FAILURE,
        ranks=[3, 2, 3],
        cause="rank 2 (node 1): killed by SIGKILL",
        fault_unix_s=999.25,
        step_before=40,
    )
    assert (opened.id, opened.ranks, opened.node, opened.state) == (
        1,
        (2, 3),
        1,
        IncidentState.OPEN,
    )
    assert opened.detection_s == pytest.approx(0.75)
    assert opened.recovery_s is None
    assert opened.steps_lost is None
    assert incidents.awaiting_restart() == [opened]
    assert incidents.counts()["rank_failure"] == 1.0
    with capture_logs() as logs:
        closed = incidents.restarted(unix_s=1004.5, restored_step=37, source="memory")
    assert [c.id for c in closed] == [1]
    got = closed[0]
    assert got.state is IncidentState.RECOVERED
    assert got.recovery_s == pytest.approx(4.5)
    assert got.steps_lost == 3  # steps 38, 39, 40 are redone
    assert got.source == "memory"
    assert incidents.awaiting_restart() == []
    # One log line with the same fields as the record.
    line = next(e for e in logs if e["event"] == "incident_closed")
    assert (line["kind"], line["ranks"], line["detection_s"], line["recovery_s"]) == (
        "rank_failure",
        [2, 3],
        0.75,
        4.5,
    )
    assert (line["steps_lost"], line["source"], line["state"]) == (3, "memory", "recovered")
    # A second restart closes nothing more.
    assert incidents.restarted(unix_s=1010.0, restored_step=40, source="durable") == []


def test_unknown_fault_time_and_a_restore_from_nothing() -> None:
    incidents = IncidentLog(node=0, clock=_Clock(50.0))
    incidents.open(IncidentKind.HANG, ranks=[0], cause="x", step_before=7)
    got = incidents.restarted(unix_s=55.0, restored_step=0, source=None)[0]
    assert got.detection_s is None
    assert got.steps_lost == 7  # no checkpoint: every step is redone
    # A recovery stamped before the declaration (a tick's reading) never goes negative.
    incidents.open(IncidentKind.HANG, ranks=[0], cause="y")
    assert incidents.restarted(unix_s=10.0, restored_step=None, source=None)[0].recovery_s == 0.0


def test_fatal_incidents_and_the_end_of_a_run() -> None:
    clock = _Clock(10.0)
    incidents = IncidentLog(node=0, clock=clock)
    a = incidents.open(IncidentKind.RANK_FAILURE, ranks=[0], cause="a")
    b = incidents.open(IncidentKind.STRAGGLER, ranks=[1], cause="b", awaits_restart=False)
    clock.now = 12.0
    ended = incidents.end_open_as_fatal()
    assert {i.id for i in ended} == {a.id, b.id}
    assert all(i.state is IncidentState.FATAL and i.ended_unix_s == 12.0 for i in ended)
    assert all(i.recovery_s is None for i in ended)  # fatal: never recovered
    assert incidents.fatal(a.id) is None  # closed once
    assert incidents.recover(b.id) is None


def test_the_log_keeps_the_last_n_newest_first_and_counts_all() -> None:
    incidents = IncidentLog(node=0, keep=3, clock=_Clock())
    for n in range(5):
        incidents.open(IncidentKind.HANG, ranks=[n], cause=str(n))
    assert [i.id for i in incidents.recent()] == [5, 4, 3]
    assert incidents.counts() == {k: (5.0 if k == "hang" else 0.0) for k in INCIDENT_KINDS}
    with pytest.raises(ValueError, match="keep at least 1"):
        IncidentLog(node=0, keep=0)


def test_closed_incidents_round_trip_through_the_file_and_a_new_log_reads_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / INCIDENTS_FILE
    clock = _Clock(100.0)
    first = IncidentLog(node=2, path=path, clock=clock)
    a = first.open(IncidentKind.HANG, ranks=[4], cause="rank 4 hung", fault_unix_s=95.0)
    first.open(IncidentKind.STRAGGLER, ranks=[5], cause="slow", awaits_restart=False)
    clock.now = 103.0
    first.restarted(unix_s=103.0, restored_step=10, source="replica")
    # Only closed incidents are written; a torn last line (a crash mid-append) is skipped.
    with path.open("a") as out:
        out.write('{"id": 9, "kind": "hang"')
    on_disk = read_incidents(path)
    assert [i.id for i in on_disk] == [a.id]
    assert on_disk[0] == next(i for i in first.recent() if i.id == a.id)
    assert json.loads(path.read_text().splitlines()[0])["detection_s"] == 5.0
    # The next daemon with the same run dir shows the history and numbers on after it.
    second = IncidentLog(node=2, path=path, clock=clock)
    assert [i.id for i in second.recent()] == [a.id]
    assert second.counts()["hang"] == 0.0  # counted by the daemon that declared it
    assert second.open(IncidentKind.HANG, ranks=[4], cause="again").id == a.id + 1
    assert read_incidents(tmp_path / "missing.jsonl") == []
    with pytest.raises(ValueError, match="not an incident"):
        Incident.from_dict({"id": 1})


def _hang(rank: int, *, cause: bool, stopped: bool = False, frame: str | None = None) -> HangReport:
    return HangReport(
        rank=rank,
        local_rank=rank,
        node=0,
        phase="data",
        step=10,
        seconds_without_progress=3.5,
        stopped=stopped,
        waiting=not cause,
        cause=cause,
        frame=frame,
        stacks="/x",
        unix_s=200.0,
    )


def test_a_declared_hang_opens_one_incident_naming_its_causes_only() -> None:
    incidents = IncidentLog(node=0, clock=_Clock(200.0))
    ledger = HangLedger(incidents)
    ledger.declare([_hang(0, cause=True, stopped=True), _hang(1, cause=False)])
    (got,) = incidents.recent()
    assert (got.kind, got.ranks, got.step_before) == (IncidentKind.HANG, (0,), 10)
    assert got.cause == "rank 0 hung in data at step 10: stopped (state T)"
    assert got.detection_s == pytest.approx(3.5)
    ledger.declare([_hang(1, cause=True, frame="job.py:3 in spin")])
    assert incidents.recent()[0].cause.endswith("job.py:3 in spin")
    ledger.declare([_hang(1, cause=False)])  # only waiters here: the cause is another node's
    assert len(incidents.recent()) == 2


def test_a_straggler_episode_is_one_incident_recovered_when_it_ends() -> None:
    clock = _Clock(300.0)
    incidents = IncidentLog(node=0, clock=clock)
    ledger = StragglerLedger(incidents)
    ledger.named(StragglerReport(rank=1, node=0, score=1.8, compute_s=0.02, unix_s=300.0))
    (got,) = incidents.recent()
    assert (got.kind, got.ranks, got.awaits_restart) == (IncidentKind.STRAGGLER, (1,), False)
    assert "score 1.80" in got.cause
    clock.now = 312.0
    ledger.recovered(1, 312.0)
    (done,) = incidents.recent()
    assert (done.state, done.recovery_s) == (IncidentState.RECOVERED, 12.0)


def test_the_status_board_shows_the_incidents_newest_first() -> None:
    incidents = IncidentLog(node=0, clock=_Clock())
    board = StatusBoard(
        max_steps=10, ckpt_uri="/x", list_checkpoints=list, incidents=incidents, run_id="r1"
    )
    assert board.snapshot()["incidents"] == []
    incidents.open(IncidentKind.HANG, ranks=[0], cause="a")
    incidents.open(IncidentKind.RANK_FAILURE, ranks=[1], cause="b")
    snap = board.snapshot()
    assert snap["run_id"] == "r1"
    assert [i["kind"] for i in snap["incidents"]] == ["rank_failure", "hang"]
    assert snap["incidents"][0]["state"] == "open"
