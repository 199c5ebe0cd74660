"""The status board behind `/api/status`: loss history, rates/ETA, errors, checkpoint listing."""

from __future__ import annotations

from ckpt_manager import CommittedCheckpoint, StorageError
from daemon.observe.collector import RankView
from daemon.observe.state import NodePhase, NodeState
from daemon.observe.status import FAILURES_SHOWN, HISTORY_POINTS, StatusBoard, format_duration
from daemon.rundir.snapshot import RankPhase


def _view(
    step: int,
    loss: float,
    tokens: float,
    failed_saves: float = 0.0,
    *,
    local_rank: int = 0,
    gauges: dict[str, float] | None = None,
) -> RankView:
    return RankView(
        rank=local_rank,
        local_rank=local_rank,
        pid=1,
        restart=0,
        world_size=1,
        phase=RankPhase.TRAINING,
        counters={
            "trainingd_train_tokens_total": {"": tokens},
            "trainingd_ckpt_saves_total": {"failed": failed_saves},
        },
        gauges={
            "trainingd_train_loss": {"": loss},
            "trainingd_train_step": {"": float(step)},
            "trainingd_rank_heartbeat_timestamp_seconds": {"": 99.0},
            **{name: {"": value} for name, value in (gauges or {}).items()},
        },
        histograms={},
    )


def test_history_is_bounded_one_point_per_new_step_with_rates_and_eta() -> None:
    clock = [100.0]
    state = NodeState(local_ranks=1)
    board = StatusBoard(
        max_steps=HISTORY_POINTS * 4,
        ckpt_uri="/x",
        clock=lambda: clock[0],
        list_checkpoints=lambda: [CommittedCheckpoint(10, 2048, 90.0)],
    )
    for step in range(1, HISTORY_POINTS + 11):
        status = state.update(phase=NodePhase.TRAINING, step=step)
        board.observe([_view(step, 1.0 / step, 100.0 * step)], status)
        board.observe([_view(step, 1.0 / step, 100.0 * step)], status)  # same step: no point
        clock[0] += 0.1
    board.refresh_checkpoints()
    s = board.snapshot()
    assert len(s["loss"]) == HISTORY_POINTS
    assert s["loss"][0][0] == 11
    assert s["loss"][-1] == [HISTORY_POINTS + 10, 1.0 / (HISTORY_POINTS + 10)]
    assert abs(s["tokens_per_s"] - 1000.0) < 20  # 100 tokens per step, 10 steps/s
    assert abs(s["eta_s"] - (3 * HISTORY_POINTS - 10) / 10) < 5
    assert s["ranks"][0]["heartbeat_age_s"] is not None
    age_s = round(clock[0] - 90.0, 1)
    assert s["checkpoints"]["committed"] == [{"step": 10, "size_bytes": 2048, "age_s": age_s}]
    assert s["last_error"] is None


def test_restarts_failed_saves_and_listing_errors_are_reported() -> None:
    state = NodeState(local_ranks=1)

    def broken() -> list[CommittedCheckpoint]:
        raise StorageError("cannot list /x")

    board = StatusBoard(max_steps=10, ckpt_uri="/x", list_checkpoints=broken)
    board.observe([_view(1, 1.0, 1.0, failed_saves=1.0)], state.update(step=1))
    assert board.snapshot()["last_error"]["message"] == "a checkpoint save failed"
    board.observe([_view(1, 1.0, 1.0, failed_saves=1.0)], state.update(restarts=1))
    assert "restart 1" in board.snapshot()["last_error"]["message"]
    board.refresh_checkpoints()
    assert board.snapshot()["checkpoints"]["error"] == "cannot list /x"


def test_rank_failures_are_listed_and_explain_the_restart() -> None:
    state = NodeState(local_ranks=1)
    board = StatusBoard(max_steps=10, ckpt_uri="/x", clock=lambda: 100.0)
    board.observe([_view(1, 1.0, 1.0)], state.update(step=1))
    for n in range(FAILURES_SHOWN + 1):
        board.note_failure({"rank": n, "reason": "exception"}, f"rank {n} (node 0): E: boom")
    status = board.snapshot()
    assert [f["rank"] for f in status["failures"]] == list(range(1, FAILURES_SHOWN + 1))
    assert status["failures"][-1]["text"] == f"rank {FAILURES_SHOWN} (node 0): E: boom"
    assert (
        status["last_error"]["message"] == f"rank failed: rank {FAILURES_SHOWN} (node 0): E: boom"
    )
    board.observe([_view(1, 1.0, 1.0)], state.update(restarts=1))
    assert board.snapshot()["last_error"]["message"] == (
        f"worker group restarted (restart 1); after rank {FAILURES_SHOWN} (node 0): E: boom"
    )


def test_tiers_show_the_memory_bytes_and_the_newest_memory_and_durable_steps() -> None:
    state = NodeState(local_ranks=2)
    held = {"local": 4096.0, "replica": 0.0}
    listed = [CommittedCheckpoint(4, 2048, 90.0), CommittedCheckpoint(8, 2048, 95.0)]
    board = StatusBoard(
        max_steps=100,
        ckpt_uri="/x",
        list_checkpoints=lambda: listed,
        tier_bytes=lambda: held,
    )
    # Before any rank reports: nothing held, the durable step from the listing.
    assert board.snapshot()["tiers"] == {
        "memory_local_bytes": 0,
        "memory_replica_bytes": 0,
        "newest_memory_step": None,
        "newest_durable_step": None,
    }
    board.refresh_checkpoints()
    assert board.snapshot()["tiers"]["newest_durable_step"] == 8
    # Rank 1 lags a snapshot: a memory step counts once every rank holds it (the lowest).
    views = [
        _view(13, 1.0, 1.0, gauges=_tier_gauges(13, 10)),
        _view(13, 1.0, 1.0, local_rank=1, gauges=_tier_gauges(12, 10)),
    ]
    held["replica"] = 1024.0
    board.observe(views, state.update(step=13))
    assert board.snapshot()["tiers"] == {
        "memory_local_bytes": 4096,
        "memory_replica_bytes": 1024,
        "newest_memory_step": 12,
        "newest_durable_step": 10,
    }
    # A rank without the tier (no gauge): no memory step for the node.
    board.observe([views[0], _view(13, 1.0, 1.0, local_rank=1)], state.update(step=13))
    assert board.snapshot()["tiers"]["newest_memory_step"] is None


def _tier_gauges(memory_step: int, durable_step: int) -> dict[str, float]:
    return {
        "trainingd_memory_newest_step": float(memory_step),
        "trainingd_ckpt_last_committed_step": float(durable_step),
    }


def test_format_duration_matches_the_page() -> None:
    assert format_duration(None) == "-"
    assert format_duration(5.4) == "5s"
    assert format_duration(3725) == "1h 2m 5s"
    assert format_duration(120) == "2m 0s"


def test_val_loss_is_one_point_per_evaluation_none_before_the_first() -> None:
    state = NodeState(local_ranks=1)
    board = StatusBoard(max_steps=100, ckpt_uri="/x", list_checkpoints=list)
    nan = float("nan")
    for step in range(1, 8):
        evaluated = step - step % 3  # evaluations at steps 3 and 6
        val = {"trainingd_val_step": float(evaluated), "trainingd_val_loss": 2.0 - evaluated / 10}
        if evaluated == 0:
            val = {"trainingd_val_step": 0.0, "trainingd_val_loss": nan}
        status = state.update(phase=NodePhase.TRAINING, step=step)
        board.observe([_view(step, 3.0, 10.0 * step, gauges=val)], status)
        if step == 2:
            assert board.snapshot()["val_loss"] == []
    assert board.snapshot()["val_loss"] == [[3, 1.7], [6, 1.4]]
