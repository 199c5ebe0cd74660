"""The kept step's file ([Note: a node keeps the step its peer's replica holds])."""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_manager._memory.keep import KEPT_STEP_FILE, KeptStep
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
