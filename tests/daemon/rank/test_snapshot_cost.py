"""The memory cadence is fed each snapshot's stall plus its staging CPU time, and the stall.

[Note: a snapshot's cost to the step] in `daemon/rank/loop.py`: `trainingd_memory_snapshot_seconds`
keeps the training thread's stall, and the cadence (`auto`) also counts the staging thread's
CPU time, which takes a core from training where every core trains.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from daemon.rank.telemetry import NullTelemetry
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


class _Stalls(NullTelemetry):
    """Keeps the stall of every snapshot the loop reports."""

    def __init__(self) -> None:
        super().__init__()
        self.stalls: list[float] = []

    def observe(self, name: str, value: float, label: str = "") -> None:
        if name == "trainingd_memory_snapshot_seconds":
            self.stalls.append(value)


def _fed_and_stalls(
    rank: int, world_size: int, root: str, memory_dir: str, every: int = 1
) -> tuple[list[tuple[float, float]], list[float], list[tuple[int, bool]]]:
    import structlog

    from daemon.rank import loop
    from daemon.rank.memory_cadence import FixedCadence
    from tests.daemon.rank._memory_loop import memory_tier_run

    fed: list[tuple[float, float]] = []

    class _Recording(FixedCadence):
        def observe_snapshot(self, step: int, snapshot_s: float, stall_s: float) -> None:
            fed.append((snapshot_s, stall_s))

    loop.cadence_for = lambda interval, **_: _Recording(every)  # type: ignore[assignment]
    cfg, job, control = memory_tier_run(
        rank, world_size, root, memory_dir, run_id="cost", ckpt_every=0, memory_every=every
    )
    telemetry = _Stalls()
    with structlog.testing.capture_logs() as events:
        loop.run_training(cfg, job, telemetry=telemetry, control=control)
    allocated = [
        (e["slot"], e["ahead"]) for e in events if e["event"] == "ckpt_memory_slot_allocated"
    ]
    return fed, telemetry.stalls, allocated


def test_the_cadence_counts_the_staging_cpu_time_besides_the_stall(tmp_path: Path) -> None:
    memory = tmp_path / "shm"
    memory.mkdir()
    [(fed, stalls, _)] = run_on_ranks(_fed_and_stalls, 1, str(tmp_path), str(memory), timeout_s=300)
    # Snapshots at steps 1-7 are fed at the next step (step 8 is the final durable save).
    assert len(fed) == len(stalls) == 7
    # The first snapshot allocated the first slot file: its cost is sent as NaN, left out of
    # the cadence ([Note: a slot's allocation is not a snapshot's cost]). The second slot's
    # file is allocated ahead on the staging thread once that copy is done ([Note: slot files
    # allocated ahead] in `ckpt_manager/_memory/tier.py`); the snapshot whose fence first
    # sees it is left out too: the first's, or the second's where the allocation outlasts the
    # next step (a loaded machine, a staging thread below the training thread). No other is.
    assert math.isnan(fed[0][0])
    assert math.isnan(fed[0][1])
    left_out = [i for i, (cost, stall) in enumerate(fed) if math.isnan(cost) or math.isnan(stall)]
    assert left_out in ([0], [0, 1]), fed
    measured = [
        (f, s) for i, (f, s) in enumerate(zip(fed, stalls, strict=True)) if i not in left_out
    ]
    # Each cost fed is the stall (through the float32 all-reduce) plus a staging time >= 0;
    # the default job's 5 MiB copy and checksum take the staging thread milliseconds of CPU.
    costs = [cost for (cost, _), _ in measured]
    reported = [stall for _, stall in measured]
    assert all(f >= s * (1 - 1e-6) for f, s in zip(costs, reported, strict=True)), fed
    assert sum(costs) - sum(reported) > 1e-4, (fed, stalls)
    # The stall rides along on its own ([Note: a snapshot's cost is also measured in the step
    # after it]): the one the loop reports, through the float32 all-reduce.
    for (_, stall), loop_stall in measured:
        assert stall == pytest.approx(loop_stall, rel=1e-6, abs=1e-9)


def test_the_loop_has_the_slots_allocated_before_its_first_snapshot(tmp_path: Path) -> None:
    # [Note: the first slots allocated ahead] in `ckpt_manager/_save/snapshots.py`: after the
    # first step the loop has both slots allocated on the staging thread, queued before the
    # first snapshot (step 3), which then finds its slot mapped. Before, that snapshot
    # allocated slot 0 between its save() and its fence, and was left out of the cadence.
    memory = tmp_path / "shm"
    memory.mkdir()
    [(fed, stalls, allocated)] = run_on_ranks(
        _fed_and_stalls, 1, str(tmp_path), str(memory), 3, timeout_s=300
    )
    assert allocated == [(0, True), (1, True)], allocated
    assert len(fed) == len(stalls) == 2  # steps 3 and 6 (8 is the final durable save)
    # Whether the first snapshot is measured depends on the reservation being done by step 3
    # (a few ms for the default job's 5 MiB slots; not guaranteed on a loaded machine); the
    # second's never overlaps one.
    assert all(math.isfinite(x) for x in fed[1]), fed
