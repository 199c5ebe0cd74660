"""How `trainingd run` ends, as an operator reads it: the last lines on stdout and the exit code.

A finished run prints "finished at step N of M" and a summary (steps, final loss, wall time,
tokens/s, where the checkpoints are, how to list them), then the default job's sample: text the
trained model writes from a fixed prompt (its weights gathered under ZeRO-3); a second run on a
root that already holds `max_steps` says so in one line, starts no rank and exits 0. A run
stopped by SIGTERM prints "stopped at step N (checkpoint committed)" and no sample: checked on
the SIGTERM run of `tests/daemon/test_e2e.py` (test_trains_scrapes_notifies_and_stops_...).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from daemon import GPT
from daemon.jobs.default_job import MODEL, sample
from tests.daemon._daemon_proc import (
    DaemonProc,
    ckptctl_restore,
    committed_steps,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_BATCH_SIZE = 4


def _stdout(d: DaemonProc) -> str:
    return d.stdout_path.read_text()


def _printed_sample(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index("trainingd: sample of the trained model:") + 1
    assert all(line.startswith("    ") for line in lines[start:]), out
    return [line.removeprefix("    ") for line in lines[start:]]


def test_a_finished_zero3_run_summarises_samples_and_a_second_run_is_already_complete(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    # One finished run serves the summary, the sample and the second run's one-line answer.
    root = tmp_path / "ckpt"
    args = ["--nproc-per-node", "2", "--batch-size", str(_BATCH_SIZE), "--warmup-steps", "1"]
    args += ["--strategy", "optim_grads_params", "--max-steps", "3", "--ckpt-uri", str(root)]
    d = DaemonProc(tmp_path, [*args, "--log-every-s", "1"], name="first")
    procs.append(d)
    assert d.wait(180) == 0, d.logs()
    out = _stdout(d)
    assert "finished at step 3 of 3: 3 steps in " in out, out
    assert "final loss " in out
    assert " tokens/s" in out
    assert f"checkpoints in {root}; list them with `" in out
    assert f"ckptctl list {root}`" in out
    assert "/metrics" not in out  # the metrics server is gone by then
    assert "trainingd: sample of the trained model:\n    The daemon " in out
    # Off a terminal (JSON logs): progress events, with the status line's fields.
    progress = d.find("progress")
    assert len(progress) >= 2, d.logs()
    assert progress[-1]["max_steps"] == 3
    keys = {"step", "loss", "tokens_per_s", "eta_s", "last_committed_step", "restarts", "phase"}
    assert keys <= set(progress[-1]), progress[-1]
    assert progress[-1]["step"] == 3, progress  # the last is the run's end, however short
    printed = _printed_sample(out)
    assert d.find("sample_generated")[0]["rank"] == 0

    # A second run on the same root (same flags, so the same run id) starts nothing.
    started = time.monotonic()
    second = DaemonProc(tmp_path, [*args, "--log-every-s", "1"], name="second")
    procs.append(second)
    assert second.wait(60) == 0, second.logs()
    elapsed_s = time.monotonic() - started
    assert _stdout(second).splitlines() == [
        f"trainingd: already at step 3 of 3 in {root}; "
        "pass --max-steps N to train further, or a new --ckpt-uri"
    ], f"{second.logs()} ({elapsed_s:.1f} s)"
    # Nothing was started: no metrics server, no rank.
    assert not second.find("daemon_started"), second.logs()
    assert not second.find("training"), second.logs()
    assert committed_steps(root) == [3]

    # The weights of the committed final step, consolidated by ckptctl, write the same text.
    exported = tmp_path / "model.pt"
    ckptctl_restore(root, 3, exported, "--only", "model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a rank: 200 tiny forwards crawl with threads fighting
    try:
        trained = sample(torch.load(exported, weights_only=True))
        torch.manual_seed(0)  # the ranks build the model right after seeding with the seed, 0
        untrained = sample(GPT(MODEL).state_dict())
    finally:
        torch.set_num_threads(threads)
    assert printed == trained.splitlines()
    assert printed != untrained.splitlines()  # written by the trained weights
