"""A durable save never stalls the loop: one rank's writer SIGSTOPped while 2 ranks train.

The ranks are held at a known step (`_gated_job`); once rank 1's writer has written every save
it was given (a save due while the first write waited for the writer to start may have been
deferred already), that writer process is stopped from outside, and the gate opens. The save
in flight cannot finish while its writer is stopped, so every later due save is deferred on
both ranks ([Note: a durable save never stalls the loop] in `daemon/rank/deferral.py`): the
loop keeps stepping, each deferred save is counted in
`trainingd_ckpt_saves_total{result="deferred"}`, each rank logs the episode once, memory
snapshots go on (the status page shows the newest memory step ahead of the newest durable
one), and nothing newer commits. After SIGCONT the durable tier catches up by itself: a later
step commits while the run goes on.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.daemon._daemon_proc import (
    GATED_JOB,
    DaemonProc,
    Gate,
    committed_steps,
    session_pids,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_BATCH_SIZE = 4
_HELD_AFTER = 6
_ARGS = [
    "--nproc-per-node", "2", "--batch-size", str(_BATCH_SIZE), "--warmup-steps", "1",
    "--max-steps", "100000", "--ckpt-every", "2", "--memory-every", "1",
    "--max-restarts", "0", "--publish-interval-s", "0.2", *GATED_JOB,
]  # fmt: skip
_STEPS_WHILE_STOPPED = 20
"""Steps the loop must train on while the writer is stopped (rank 0 logs every 10th)."""


def _writer_pid(d: DaemonProc, rank: int) -> int | None:
    """The checkpoint writer process of `rank` (`python -m ckpt_manager._save.writer`)."""
    for pid in session_pids(d.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"ckpt_manager._save.writer" in argv
            and argv[argv.index(b"--rank") + 1] == str(rank).encode()
        ):
            return pid
    return None


def _rank_writes_done(root: Path, rank: int) -> bool:
    """Every step folder holds `rank`'s index, the last object its writer writes for a save."""
    steps = [p for p in root.glob("step-*") if p.is_dir()]
    return bool(steps) and all((p / f"rank-{rank:05d}.index.json").exists() for p in steps)


def _api(d: DaemonProc) -> dict[str, Any]:
    code, body = d.get("/api/status")
    assert code == 200, body
    return dict(json.loads(body))


def _caught_up_after(d: DaemonProc, step: int) -> list[dict[str, Any]]:
    """`checkpoint_caught_up` events of the episode that began at `step`."""
    return [e for e in d.find("checkpoint_caught_up") if int(e["deferred_from_step"]) == step]


def _newest_logged_step(d: DaemonProc) -> int:
    return max((int(e["step"]) for e in d.find("step")), default=0)


def test_a_stopped_writer_defers_saves_and_the_durable_tier_catches_up(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    root = tmp_path / "ckpt"
    gate = Gate(tmp_path / "gate", after_steps=_HELD_AFTER, batch_size=_BATCH_SIZE)
    d = DaemonProc(tmp_path, [*_ARGS, "--ckpt-uri", str(root)], gate.env)
    procs.append(d)
    gate.wait_until_held(2, d, timeout_s=120)
    writer = wait_for(lambda: _writer_pid(d, 1), 30, "rank 1's writer process")
    wait_for(lambda: _rank_writes_done(root, 1), 30, "rank 1's writes before the gate")
    os.kill(writer, signal.SIGSTOP)
    # Events of an episode before the gate (its owed save is taken at the first step after).
    num_before = len(d.find("checkpoint_deferred"))
    try:
        gate.open()

        def trained_on() -> bool:
            assert d.exit_code() is None, d.logs()
            return _newest_logged_step(d) >= _HELD_AFTER + _STEPS_WHILE_STOPPED

        wait_for(trained_on, 90, f"{_STEPS_WHILE_STOPPED} steps with rank 1's writer stopped")
        # Every due save since is deferred: counted each, logged once per rank.
        deferred = wait_for(
            lambda: d.max_value("trainingd_ckpt_saves_total", result="deferred") >= 5,
            30,
            "deferred saves on /metrics",
        )
        assert deferred
        episodes = d.find("checkpoint_deferred")[num_before:]
        assert sorted(int(e["rank"]) for e in episodes) == [0, 1], episodes
        first = {int(e["ckpt_step"]) for e in episodes}
        assert len(first) == 1, episodes
        (first_deferred,) = first
        inflight = {int(e["inflight_step"]) for e in episodes}
        assert len(inflight) == 1, episodes
        assert _HELD_AFTER <= min(inflight) < first_deferred, episodes
        # Nothing newer than the save in flight commits; memory holds the newest state.
        assert all(s < first_deferred for s in committed_steps(root)), committed_steps(root)
        tiers = wait_for(
            lambda: (
                (t := _api(d)["tiers"])["newest_memory_step"] is not None
                and t["newest_memory_step"] >= first_deferred
                and t
            ),
            30,
            "the newest memory step on /api/status",
        )
        assert tiers["newest_durable_step"] is None or tiers["newest_durable_step"] < first_deferred
        assert tiers["memory_local_bytes"] > 0, tiers
        assert not _caught_up_after(d, first_deferred), d.logs()
    finally:
        os.kill(writer, signal.SIGCONT)

    # The writer is free again: the owed save is taken at the next step and commits.
    wait_for(lambda: len(_caught_up_after(d, first_deferred)) == 2, 60, "both ranks caught up")
    caught_up = {int(e["ckpt_step"]) for e in _caught_up_after(d, first_deferred)}
    assert len(caught_up) == 1, caught_up
    wait_for(
        lambda: any(s >= min(caught_up) for s in committed_steps(root)),
        60,
        "a commit after the writer was continued",
    )
    assert d.exit_code() is None, d.logs()
    d.signal(signal.SIGTERM)
    assert d.wait(120) == 128 + signal.SIGTERM, d.logs()
    stopped_at = {int(e["step"]) for e in d.find("stopping")}
    assert committed_steps(root)[-1] in stopped_at, (committed_steps(root), stopped_at)
