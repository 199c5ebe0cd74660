"""The run's failure policy for saves, end to end: `trainingd run` with failing writers.

Writers fail at chosen steps through the writer's fault hook (an environment variable read by
the writer processes the ranks start), so which saves fail is exact, not a matter of timing.
Which call finds a failure does vary with the machine's speed (a `maybe_finalize` a step or
two after the write failed, possibly a call apart on the two ranks, or the `save()` that makes
room for the next step); what the tests assert does not: saves commit in order, one at a time
(`max_inflight` 1), so the failures, their count in a row and the committed steps are the same
on every machine. Under load a rank that found a failure one call before its peer used to wait
for it in a checkpoint collective while the peer waited in the next training step, until the
300 s group timeout ([Note: a failed save is cleaned up in rounds too] in
`ckpt_manager/_save/finalize.py`; `tests/ckpt_manager/save/test_finalize.py` makes that order
happen every time).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_manager._save.writer import FAULT_ENV
from tests.daemon._daemon_proc import DaemonProc, committed_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_RUN = ["--nproc-per-node", "2", "--batch-size", "4", "--warmup-steps", "1"]
_RUN += ["--max-steps", "10", "--ckpt-every", "2", "--max-restarts", "0"]


def test_failed_saves_are_reported_and_training_continues(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    root = tmp_path / "ckpt"
    d = DaemonProc(
        tmp_path,
        [*_RUN, "--ckpt-uri", str(root)],
        env={FAULT_ENV: "raise@2,raise@4"},  # two failures in a row, then saves work again
    )
    procs.append(d)
    assert d.wait(180) == 0, d.logs()
    assert committed_steps(root) == [6, 8, 10]
    failed = d.find("checkpoint_failed_training_continues")
    assert sorted({(e["ckpt_step"], e["consecutive_failures"]) for e in failed}) == [(2, 1), (4, 2)]


def test_too_many_failed_saves_in_a_row_stop_the_run(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    root = tmp_path / "ckpt"
    d = DaemonProc(
        tmp_path,
        [*_RUN, "--ckpt-uri", str(root), "--max-consecutive-save-failures", "3"],
        # The third failure (step 6) is found at the latest when save(8) makes room for itself
        # (maybe_finalize polls without waiting, so a step or two after the write failed). Save 8
        # is queued by then and finalized as the run stops, so it fails too: no step commits
        # whichever call finds the failure.
        env={FAULT_ENV: "raise@2,raise@4,raise@6,raise@8"},
    )
    procs.append(d)
    assert d.wait(180) != 0
    assert "3 checkpoint saves failed in a row (max_consecutive_save_failures=3)" in d.logs()
    assert committed_steps(root) == []
