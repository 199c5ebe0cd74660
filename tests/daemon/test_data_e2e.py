"""End to end: `trainingd run --data FILE` trains the default GPT on a token file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from daemon.data import write_token_file
from daemon.jobs.default_job import corpus
from tests.daemon._daemon_proc import DaemonProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_run_on_a_token_file_trains_and_finishes(tmp_path: Path, procs: list[DaemonProc]) -> None:
    tokens = np.frombuffer(corpus(100_000), dtype=np.uint8)
    data = str(tmp_path / "corpus.bin")
    write_token_file(data, [tokens], vocab_size=256)
    args = [
        "--nproc-per-node", "2", "--batch-size", "4", "--max-steps", "30", "--warmup-steps", "2",
        "--ckpt-every", "0", "--ckpt-uri", str(tmp_path / "ckpt"), "--data", data,
    ]  # fmt: skip
    run = DaemonProc(tmp_path, args)
    procs.append(run)
    assert run.wait(180) == 0, run.logs()
    losses = [float(e["loss"]) for e in run.find("step")]
    assert losses, run.logs()
    assert losses[-1] < 4.0, losses  # from ln(256) ~ 5.5: it learned from the file's bytes
