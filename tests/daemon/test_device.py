"""Device selection: `auto|cpu|cuda` against what this node has (CUDA faked where needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daemon._device import cuda_problem, process_group_backend, resolve_device
from daemon.config import Device


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_picks_cuda_for_the_local_rank_when_the_node_has_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpus(monkeypatch, 4)
    assert resolve_device(Device.AUTO, 3) == torch.device("cuda", 3)
    assert resolve_device(Device.CUDA, 0) == torch.device("cuda", 0)
    assert resolve_device(Device.CPU, 2) == torch.device("cpu")
    assert cuda_problem(Device.AUTO, 4) is None


def test_auto_falls_back_to_the_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 0)
    assert resolve_device(Device.AUTO, 1) == torch.device("cpu")
    assert cuda_problem(Device.AUTO, 8) is None
    assert cuda_problem(Device.CPU, 8) is None


def test_cuda_without_a_gpu_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 0)
    problem = cuda_problem(Device.CUDA, 1)
    assert problem is not None
    assert problem.startswith("device=cuda: CUDA is not available on this node")
    assert "--device cpu" in problem
    assert "\n" not in problem
    with pytest.raises(RuntimeError, match="local rank 0 has no GPU"):
        resolve_device(Device.CUDA, 0)


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    problem = cuda_problem(Device.AUTO, 4)
    assert problem is not None
    assert "needs one GPU per rank, this node has 2; set --nproc-per-node 2" in problem


def test_nccl_trains_on_cuda_and_gloo_on_the_cpu() -> None:
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainingd_trains_on_cuda_with_nccl(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAININGD_")}
    result = subprocess.run(
        [
            Path(sys.executable).parent / "trainingd",
            "run",
            "--device=cuda",
            "--nproc-per-node=1",
            "--max-steps=5",
            "--ckpt-every=0",
            f"--ckpt-uri={tmp_path / 'ckpt'}",
            "--metrics-port=0",
            "--log-format=json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "ckpt" / f"step-{5:012d}" / "manifest.json").exists()
