"""Deletes the store refuses (an immutable file, made from outside with `chattr +i`).

Retention must log and retry them, keep deleting the other steps, and never hold up
`wait_until_finished` or a shutdown for more than a few seconds.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast
from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._retention.deleter import MAX_WAIT_S

CHATTR = shutil.which("chattr")


@pytest.fixture
def immutable(tmp_path: pathlib.Path) -> Iterator[list[pathlib.Path]]:
    """Paths appended here are made immutable now-ish by the test, and mutable again after."""
    if CHATTR is None or os.geteuid() != 0:
        pytest.skip("needs root and chattr to make a file immutable")
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    if subprocess.run([CHATTR, "+i", str(probe)], capture_output=True, check=False).returncode:
        pytest.skip(f"{tmp_path} does not support immutable files")
    subprocess.run([CHATTR, "-i", str(probe)], check=True)
    paths: list[pathlib.Path] = []
    yield paths
    for path in paths:
        subprocess.run([CHATTR, "-i", str(path)], check=False)


def test_a_denied_delete_holds_up_neither_waits_nor_shutdown(
    tmp_path: pathlib.Path, immutable: list[pathlib.Path], log_events: list[dict[str, Any]]
) -> None:
    root = tmp_path / "ckpt"
    keep_all = CheckpointConfig(async_mode=AsyncMode.SYNC, retention=KeepLast(n=10))
    with CheckpointManager(str(root), keep_all, run_id="r") as mgr:
        for step in (1, 2):
            mgr.save(step, {"t": torch.full((4,), float(step))})
    denied = root / step_dir(1) / MANIFEST_NAME
    immutable.append(denied)
    subprocess.run([CHATTR, "+i", str(denied)], check=True)

    # A finalize timeout far longer than any wait this test tolerates.
    cfg = CheckpointConfig(
        async_mode=AsyncMode.SYNC,
        retention=KeepLast(n=1),
        finalize_timeout_s=120,
        deletion_retry_s=0.2,
    )
    t0 = time.monotonic()
    mgr = CheckpointManager(str(root), cfg, run_id="r")
    mgr.save(3, {"t": torch.full((4,), 3.0)})
    mgr.wait_until_finished()
    waited_s = time.monotonic() - t0
    t1 = time.monotonic()
    mgr.close()
    closed_s = time.monotonic() - t1

    bound_s = 3 * MAX_WAIT_S  # the cap plus generous slack for a busy machine
    assert waited_s < bound_s, f"wait_until_finished took {waited_s:.1f} s"
    assert closed_s < bound_s, f"close took {closed_s:.1f} s"
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert steps == [step_dir(1), step_dir(3)]  # step 2 deleted despite step 1's denial
    assert any(
        e["event"] == "ckpt_retention_failed" and e.get("ckpt_step") == 1 for e in log_events
    )
