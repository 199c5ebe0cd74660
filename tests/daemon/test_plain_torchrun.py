"""The rank entry point without the daemon: `torchrun -m daemon.worker` (README, Plain torchrun).

No run directory exists there, so nothing reads rank snapshots and the rank records no
metrics at all (`NullTelemetry`); training and checkpoints work as under `trainingd run`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.daemon._daemon_proc import BIN, committed_steps
from tests.support.dist import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _torchrun_worker(tmp_path: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(BIN / "torchrun"),
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "daemon.worker",
            "--max-steps",
            "4",
            "--ckpt-every",
            "2",
            "--batch-size",
            "4",
            "--warmup-steps",
            "1",
            "--ckpt-uri",
            str(tmp_path / "ckpt"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
        check=False,
    )


def test_worker_trains_in_bf16_and_checkpoints_under_torchrun_without_a_run_dir(
    tmp_path: Path,
) -> None:
    # One 2-rank torchrun covers both: the plain-torchrun path (no run directory, no snapshot
    # files) and bf16 training with bf16 gradient reduction.
    out = _torchrun_worker(
        tmp_path, 2, "--param-dtype", "bfloat16", "--reduce-dtype", "bfloat16", "--lr", "0.001"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert committed_steps(tmp_path / "ckpt") == [2, 4]
    assert not (tmp_path / "ranks").exists()  # no snapshot files anywhere
