"""The kept step's file ([Note: a node keeps the step its peer's replica holds])."""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_manager import MemoryTierConfig
from ckpt_manager._memory.keep import KEPT_STEP_FILE, KeptStep
from ckpt_manager._memory.tier import MemoryTier, SnapshotJob
from ckpt_manager.memory_slots import write_kept_step


def test_the_kept_step_is_read_back_per_version_and_only_for_this_run(tmp_path: Path) -> None:
    reader = KeptStep(str(tmp_path), "run-a")
    assert reader.step() is None  # nothing asked
    write_kept_step(str(tmp_path), "run-a", 7)
    assert reader.step() == 7
    write_kept_step(str(tmp_path), "run-a", 9)  # a new file (rename): read again
    assert reader.step() == 9
    write_kept_step(str(tmp_path), "run-b", 11)
    assert reader.step() is None  # another run's
    (tmp_path / KEPT_STEP_FILE).write_text('{"run_id": "run-a", "st')
    assert reader.step() is None  # torn: no evidence
    os.unlink(tmp_path / KEPT_STEP_FILE)
    assert reader.step() is None
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp file left


def test_a_snapshot_keeps_the_kept_step_and_yields_it_rather_than_skip(tmp_path: Path) -> None:
    tier = MemoryTier(
        MemoryTierConfig(str(tmp_path)), rank=0, world_size=1, run_id="run-a", max_extra=1
    )
    tier.after_restore(None)  # nothing inherited
    tier.held = {0: 4, 1: 5}  # step 5 newest
    write_kept_step(str(tmp_path), "run-a", 4)
    # Both primary slots held (newest, kept): the extra slot, step 4 stays.
    assert tier.choose(set()) == (2, True)
    tier.held[2] = 6
    # Slot 2 (now the newest) and slot 0 (kept) are out; slot 1 (step 5) is taken.
    assert tier.choose(set()) == (1, False)
    # A durable write pins slot 1 while slot 2 holds the newest: the kept step has a slot of
    # its own beyond the durable write's extra one (a node loss measured 3 of 6 falls back to
    # durable when the kept step yielded here: rank 0 held [45, 46, 47], the replica 43).
    tier.held = {0: 4, 1: 5, 2: 6}
    assert tier.choose({1}) == (3, True)
    assert tier.num_skipped == 0


def test_a_refused_extra_slot_does_not_refuse_the_others(tmp_path: Path) -> None:
    tier = MemoryTier(
        MemoryTierConfig(str(tmp_path)), rank=0, world_size=1, run_id="run-a", max_extra=1
    )
    tier.after_restore(None)
    write_kept_step(str(tmp_path), "run-a", 4)
    tier.held = {0: 4, 1: 5, 2: 6}
    assert tier.choose({1}) == (3, True)
    # The tmpfs has no room for slot 3: that snapshot is skipped, counted once.
    job = SnapshotJob(slot=3, step=7, flat=None, durable=[], extra=True, skipped="no room")
    tier.finish(job)
    assert tier.num_skipped == 1
    # From now on the kept step yields instead (no skip) ...
    assert tier.choose({1}) == (0, False)
    # ... and slot 2, allocated before, is still used when both primary slots are held.
    tier.held = {0: 4, 1: 5}
    assert tier.choose(set()) == (2, True)
    assert tier.num_skipped == 1
