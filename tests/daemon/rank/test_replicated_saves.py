"""Which of the loop's saves go to the peer ring: [Note: under `auto` a durable save between two
snapshots stays on its node] in `daemon/rank/memory_cadence.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


def _saves(
    rank: int, world_size: int, root: str, memory_dir: str
) -> tuple[list[tuple[int, bool, bool]], dict[int, bool], list[Any]]:
    from ckpt_manager import CheckpointManager
    from ckpt_manager.memory_slots import SlotFiles
    from daemon.rank import loop
    from daemon.rank.memory_cadence import FixedCadence
    from daemon.rank.telemetry import NullTelemetry
    from tests.daemon.rank._memory_loop import memory_tier_run

    class _DueEveryThird(FixedCadence):
        """Every third step, and a durable save counts only at one of those: a cadence that
        counts some durable saves and not others, so the loop's verdict per save shows."""

        def counts_durable_save(self, step: int) -> bool:
            return self.due(step)

    asked: list[Any] = []

    def cadence_for(interval: Any, **kwargs: Any) -> FixedCadence:
        asked.append(kwargs)
        return _DueEveryThird(3)

    calls: list[tuple[int, bool, bool]] = []
    save = CheckpointManager.save

    def recording_save(self: Any, step: int, state: Any, *args: Any, **kwargs: Any) -> None:
        calls.append((step, kwargs.get("durable", True), kwargs.get("replicate", True)))
        save(self, step, state, *args, **kwargs)

    loop.cadence_for = cadence_for  # type: ignore[assignment]
    CheckpointManager.save = recording_save  # type: ignore[method-assign]
    cfg, job, control = memory_tier_run(
        rank, world_size, root, memory_dir, run_id="replicate", ckpt_every=2, memory_every=3
    )
    loop.run_training(cfg, job, telemetry=NullTelemetry(), control=control)
    metas = SlotFiles(str(cfg.memory_tier_dir), rank).read_metas()
    held = {int(m["step"]): m.get("replicate", True) for m in metas.values() if isinstance(m, dict)}
    return calls, held, asked


def test_a_durable_save_the_cadence_does_not_count_is_kept_on_its_node(tmp_path: Path) -> None:
    memory = tmp_path / "shm"
    memory.mkdir()
    [(calls, held, asked)] = run_on_ranks(_saves, 1, str(tmp_path), str(memory), timeout_s=300)
    # A single node has no peer replicas: `auto` would count every durable save.
    assert asked == [{"peer_replicas": False}]
    # Durable saves at 2, 4, 6 and 8, memory-only snapshots at 3 and 6 (a durable save still
    # being written defers the next one, which then goes to memory alone or comes a step
    # later: the rule below holds either way). Replicated: exactly the cadence's steps.
    assert (2, True, False) in calls, calls
    assert (3, False, True) in calls, calls
    assert any(step == 6 and replicate for step, _, replicate in calls), calls
    assert all(replicate == (step % 3 == 0) for step, _, replicate in calls), calls
    # The metas say so: the final save (step 8) stays on its node.
    assert held[8] is False, held
    assert all(replicate == (step % 3 == 0) for step, replicate in held.items()), held
