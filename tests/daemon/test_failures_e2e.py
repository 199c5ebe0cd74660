"""Failures end to end: `trainingd run` with a job that fails (`tests/daemon/_failing_job.py`).

A job raising at the same step on every attempt is not retried past the second attempt: exit 1
with a summary on stdout naming rank, step and error. A job whose build raises, or whose own
`init_from` weights do not fit, fails before training: exit 2 with one line, no retry; a bad
`--init-from` is refused by the start-up checks, one line naming the key and both shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from daemon import GPT
from daemon.jobs.default_job import MODEL
from tests.daemon import _failing_job
from tests.daemon._daemon_proc import DaemonProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_JOB = ["--job", "tests.daemon._failing_job:build"]
_RUN = ["--nproc-per-node", "2", "--batch-size", "2", "--warmup-steps", "1", "--max-steps", "8"]
# No save before the failure (each attempt starts at step 1); budget for 4 attempts.
_RUN += ["--ckpt-every", "0", "--max-restarts", "3", *_JOB]
_ONE_RANK = ["--nproc-per-node", "1"]  # failures before training: one rank says as much
_KEY = "blocks.0.attn.qkv.weight"


def _daemon_failures(d: DaemonProc) -> list[dict[str, object]]:
    """The daemon's `rank_failed` events (the ranks log their own, without a `reason`)."""
    return [e for e in d.find("rank_failed") if "reason" in e]


def test_the_same_error_at_the_same_step_ends_the_run_after_two_attempts(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    env = {_failing_job.STEP_ENV: "3", _failing_job.RANK_ENV: "1"}
    d = DaemonProc(tmp_path, [*_RUN, "--ckpt-uri", str(tmp_path / "ckpt")], env=env)
    procs.append(d)
    assert d.wait(200) == 1, d.logs()
    failures = _daemon_failures(d)
    assert [(e["rank"], e["restart"], e["reason"], e["step"]) for e in failures] == [
        (1, 0, "exception", 3),
        (1, 1, "exception", 3),
    ], d.logs()
    assert failures[0]["exc_type"] == "ValueError"
    assert failures[0]["traceback_tail"][-1] == "ValueError: the job fails at step 3"  # type: ignore[index]
    out = d.stdout_path.read_text().splitlines()
    assert out[0].startswith("trainingd: run "), out
    assert (
        "failed: the same error on attempts 1 and 2 (deterministic: not retried): "
        "rank 1 (node 0) at step 3: ValueError: the job fails at step 3"
    ) in out[0]
    assert out[1].startswith("trainingd:   raised at "), out
    assert "_failing_job.py:" in out[1], out
    assert len(out) == 2, out  # one short block, no traceback


def test_a_job_whose_build_raises_exits_2_without_retries(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    env = {_failing_job.BUILD_ENV: "1"}
    d = DaemonProc(tmp_path, [*_RUN, *_ONE_RANK, "--ckpt-uri", str(tmp_path / "ckpt")], env=env)
    procs.append(d)
    assert d.wait(200) == 2, d.logs()
    failures = _daemon_failures(d)
    assert failures, d.logs()
    assert {(e["restart"], e["reason"]) for e in failures} == {(0, "config")}, d.logs()
    lines = [x for x in d.stderr_path.read_text().splitlines() if x.startswith("trainingd: ")]
    assert len(lines) == 1, d.logs()
    assert (
        " (node 0) failed before training: RuntimeError: the job's build fails on purpose"
        in (lines[0])
    )
    assert d.stdout_path.read_text() == ""


def _wrong_shape(path: Path) -> tuple[int, ...]:
    """The default job's weights with one row missing from `_KEY`; that tensor's model shape."""
    weights = {k: v.clone().contiguous() for k, v in GPT(MODEL).state_dict().items()}
    shape = tuple(weights[_KEY].shape)
    weights[_KEY] = weights[_KEY][1:].contiguous()
    save_file(weights, str(path), metadata={"format": "pt"})
    return shape


def test_init_from_weights_of_the_wrong_shape_exit_2_naming_key_and_shapes(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    source = tmp_path / "model.safetensors"
    shape = _wrong_shape(source)
    wrong = (shape[0] - 1, *shape[1:])
    expected = f"{_KEY!r} has shape {wrong} in the file, {shape} in the model"
    # Named by `--init-from`: refused by the start-up checks, before any rank starts.
    d = DaemonProc(
        tmp_path,
        [*_RUN, "--ckpt-uri", str(tmp_path / "a"), "--init-from", str(source)],
        name="flag",
    )
    procs.append(d)
    assert d.wait(120) == 2, d.logs()
    lines = [x for x in d.stderr_path.read_text().splitlines() if x.startswith("trainingd: ")]
    assert len(lines) == 1, d.logs()
    assert expected in lines[0], d.logs()
    # Named by the job itself: checked on the ranks, before the first step; not retried.
    env = {_failing_job.INIT_FROM_ENV: str(source)}
    args = [*_RUN, *_ONE_RANK, "--ckpt-uri", str(tmp_path / "b")]
    d = DaemonProc(tmp_path, args, env=env, name="job")
    procs.append(d)
    assert d.wait(200) == 2, d.logs()
    assert {(e["restart"], e["reason"]) for e in _daemon_failures(d)} == {(0, "config")}
    lines = [x for x in d.stderr_path.read_text().splitlines() if x.startswith("trainingd: ")]
    assert len(lines) == 1, d.logs()
    assert "failed before training: JobError: " in lines[0], d.logs()
    assert expected in lines[0], d.logs()
