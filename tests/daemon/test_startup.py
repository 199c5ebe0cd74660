"""A bad configuration fails `trainingd run` at start: one line, exit code 2, no rank started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.dist import free_port

TRAININGD = Path(sys.executable).parent / "trainingd"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAININGD_")}
    return subprocess.run(
        [TRAININGD, "run", "--metrics-port", "0", "--log-format", "json", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )


def _bad_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    toml = tmp_path / "bad.toml"
    toml.write_text("[train]\nmax_steps = 10\nlearning_rate = 0.1\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    closed = free_port()
    return {
        "unknown key": (["--config", str(toml)], "unknown config key 'learning_rate'"),
        "negative steps": (["--max-steps", "-5"], "max_steps=-5: use 0 or more"),
        "unreachable s3": (
            [
                "--ckpt-uri",
                "s3://bucket/run",
                "--s3-endpoint-url",
                f"http://127.0.0.1:{closed}",
            ],
            f"S3 endpoint 'http://127.0.0.1:{closed}' is unreachable",
        ),
        "unwritable path": (
            ["--ckpt-uri", str(a_file / "ckpt")],
            f"checkpoint root {a_file / 'ckpt'} is not writable",
        ),
        "missing job": (["--job", "nosuchmodule:build"], "cannot import nosuchmodule"),
        # The memory tier asked for explicitly where it cannot be made (`auto` goes without).
        "unwritable memory_dir": (
            ["--memory-every", "5", "--memory-dir", str(a_file / "shm")],
            f"memory_dir={str(a_file / 'shm')!r}: cannot list it (Not a directory)",
        ),
        "cuda without a gpu": (["--device", "cuda"], "device=cuda: CUDA is not available"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown key",
        "negative steps",
        "unreachable s3",
        "unwritable path",
        "missing job",
        "unwritable memory_dir",
        "cuda without a gpu",
    ],
)
def test_bad_config_exits_2_with_one_line_before_any_rank(tmp_path: Path, case: str) -> None:
    if case == "cuda without a gpu" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    args, expected = _bad_cases(tmp_path)[case]
    result = _run(args, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 or all(line.startswith("{") for line in lines[:-1]), lines
    assert lines[-1].startswith("trainingd: ")
    assert expected in lines[-1]
    assert "training" not in result.stderr.replace("trainingd", "")  # no rank started
    assert result.stdout == ""


def test_missing_bucket_on_a_live_endpoint_exits_2(tmp_path: Path, s3: object) -> None:
    endpoint = s3.endpoint_url  # type: ignore[attr-defined]
    result = _run(
        ["--ckpt-uri", "s3://no-such-bucket/run", "--s3-endpoint-url", endpoint], tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert "bucket 'no-such-bucket' does not exist" in result.stderr.strip().splitlines()[-1]


_HOLDER = """
import pathlib, sys, time
from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.5)
with CheckpointManager(sys.argv[1], cfg, run_id="the-holder"):
    pathlib.Path(sys.argv[2]).write_text("held")
    time.sleep(120)
"""


def test_a_root_whose_lease_is_live_exits_2_naming_the_holder(tmp_path: Path) -> None:
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the holder never took the lease"
        result = _run(["--ckpt-uri", str(root), "--max-steps", "1"], tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("trainingd: ")
    assert f"run 'the-holder' (host {socket.gethostname()}, pid {holder.pid}, refresh #" in line
    assert "last refresh 20" in line
    assert "training" not in result.stderr.replace("trainingd", "")  # no rank started


def test_both_nodes_of_a_new_two_node_job_exit_2_on_a_root_another_run_holds(
    tmp_path: Path,
) -> None:
    # [Note: a node joining a running job skips the root checks]: a node of a multi-node job
    # checks the root after its first rendezvous; in the job's first round every node does,
    # and fails as a single node does: exit 2, the holder named, no rank started.
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), str(ready)])
    endpoint = f"127.0.0.1:{free_port()}"
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the holder never took the lease"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAININGD_")}
        args = [
            "run", "--metrics-port", "0", "--log-format", "json", "--ckpt-uri", str(root),
            "--max-steps", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
            "--rdzv-timeout-s", "60",
        ]  # fmt: skip
        # Files, not pipes: a node is never blocked on a full pipe while the other is waited.
        logs = [tmp_path / f"node{k}.err" for k in (0, 1)]
        for k in (0, 1):
            with logs[k].open("w") as err_file:
                nodes.append(
                    subprocess.Popen(
                        [TRAININGD, *args, "--node-rank", str(k)],
                        stdout=subprocess.DEVNULL,
                        stderr=err_file,
                        env=env,
                        cwd=tmp_path,
                    )
                )
        codes = [node.wait(timeout=150) for node in nodes]
    finally:
        for process in [holder, *nodes]:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)
    for code, log in zip(codes, logs, strict=True):
        err = log.read_text()
        assert code == 2, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("trainingd: "), line
        assert f"run 'the-holder' (host {socket.gethostname()}, pid {holder.pid}" in line
        assert "root_checks_skipped" not in err
        assert '"event": "training"' not in err  # no rank started
