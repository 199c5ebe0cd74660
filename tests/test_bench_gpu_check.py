"""`bench/gpu_check.py` stays runnable: its plan and JSON shape on CPU, the whole check on CUDA.

One run goes through the script as a subprocess (the plan: stdout is one JSON object alone);
the other CPU checks call the same module's `main` in process, which is what the script runs,
so that they do not import torch again in a fresh interpreter each.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
PARTS = {"parity", "staging", "resume", "metrics", "memory"}


def _check(*args: str, timeout_s: float = 120) -> tuple[int, dict[str, Any] | None, str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = result.stdout.strip().splitlines()
    # One JSON object, alone on stdout.
    parsed = json.loads(lines[0]) if len(lines) == 1 else None
    return result.returncode, parsed, result.stderr


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """The script loaded as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses resolve their annotations through sys.modules while the module executes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _main(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, dict[str, Any] | None, str]:
    """`main(args)` in process: its exit code (argparse's for a usage error), the one JSON
    object it printed (None unless stdout is exactly one line), and what it wrote to stderr."""
    try:
        code = int(gpu_check.main(list(args)))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, json.loads(lines[0]) if len(lines) == 1 else None, err


def test_dry_run_prints_the_plan_as_one_json_object_and_meets_the_issues_floors() -> None:
    code, result, stderr = _check("--dry-run")
    assert code == 0, stderr
    assert result is not None
    assert set(result["parts"]) == PARTS
    assert all(part == {"pass": None, "not_run": "dry run"} for part in result["parts"].values())
    assert result["pg_timeout_s"] <= 60
    assert result["plan"]["parity_params"] >= 100_000_000
    assert result["plan"]["staging_bytes"] >= 4 << 30
    assert result["plan"]["budget_s"] < 8 * 60
    assert result["plan"]["floors"] == {
        "parity_params_ge_100M": True,
        "staging_bytes_ge_4GiB": True,
    }


def test_a_subset_of_parts_and_a_bad_part_name(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, _ = _main(gpu_check, capsys, "--dry-run", "--parts", "staging,parity")
    assert code == 0
    assert result is not None
    assert set(result["parts"]) == {"staging", "parity"}
    code, result, stderr = _main(gpu_check, capsys, "--dry-run", "--parts", "staging,gemm")
    assert code == 2
    assert result is None
    assert "--parts: unknown ['gemm']" in stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_every_part_fails_with_the_reason(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, _ = _main(gpu_check, capsys, "--parts", "staging")
    assert code == 1
    assert result is not None
    assert result["pass"] is False
    assert result["parts"] == {"staging": {"pass": False, "error": "CUDA is not available"}}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_check_passes() -> None:
    code, result, stderr = _check(timeout_s=540)
    assert result is not None, stderr
    failed = {name: part for name, part in result["parts"].items() if part.get("pass") is not True}
    assert code == 0, json.dumps(failed, indent=1)
