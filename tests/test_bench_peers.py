"""The issue-20 peer benchmarks stay runnable: each `--smoke --json` run prints one JSON object
with every key the issue names, as median with min-max over rounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
CKPT_KEYS = (
    "stall_vs_dcp_best",
    "inflation_vs_dcp_best",
    "save_cpu_vs_memcpy",
    "inflation_vs_memcpy_spare_core",
    "local_write_vs_raw",
    "s3_write_vs_s3fs",
    "stall_vs_dcp_async",
    "inflation_vs_memcpy_spare_core_stepwise",
    "save_fixed_cpu_s",
)
SHARDING_KEYS = (
    "zero3_vs_fsdp2_step_time",
    "zero3_vs_fsdp2_step_time_4r",
    "zero3_vs_fsdp2_step_time_bf16",
    "noshard_vs_ddp_step_time",
    "zero3_vs_ddp_peak_rss_big",
    "zero3_vs_fsdp2_peak_rss_big",
)


def _run(script: str, *args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--json", *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    parsed: dict[str, Any] = json.loads(result.stdout)  # one object, alone on stdout
    return parsed


def _is_spread(value: Any) -> bool:
    return isinstance(value, dict) and value["min"] <= value["median"] <= value["max"]


def _is_interval(value: Any) -> bool:
    """A median inside its min-max and its bootstrap 95% interval (issue 33)."""
    return _is_spread(value) and value["ci95_lo"] <= value["median"] <= value["ci95_hi"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ckpt_vs_dcp_smoke_reports_every_peer_ratio() -> None:
    report = _run("ckpt_vs_dcp.py")
    assert set(CKPT_KEYS) <= set(report)
    assert report["s3_write_vs_s3fs"] is None  # the smoke run skips S3
    # A wall-clock key whose A/A noise floor is unknown (one round has no A/A pair) or too
    # high is null, with the reason (issue 33); the others are medians with an interval.
    unresolved = report["unresolved"]
    for key in set(CKPT_KEYS) - {"s3_write_vs_s3fs"}:
        if key in unresolved:
            assert report[key] is None
            assert unresolved[key].startswith("unresolved on this machine"), unresolved[key]
            assert report["verdicts"][key] == "unresolved on this machine"
        else:
            assert _is_interval(report[key]), (key, report[key])
    assert set(unresolved) <= {"inflation_vs_dcp_best", "inflation_vs_memcpy_spare_core"}
    assert report["memcpy_gib_s"] > 0
    assert report["save_fixed_cpu_s"]["median"] > 0
    # Each save over the memcpy timed right after it (issue 33, helper `savecpu`).
    assert _is_interval(report["save_cpu_vs_memcpy_paired"])
    assert report["memcpy_paired_s"]["min"] > 0
    assert report["targets"]["save_fixed_cpu_s"][1] == pytest.approx(0.25 * report["memcpy_s"])
    assert set(report["verdicts"]) == set(report["targets"])
    assert {"dcp_best", "dcp_async", "ours", "ours_spare_core"} <= set(report["peers"])
    assert report["conditions_before"]["loadavg_1_5_15"]
    assert report["conditions_after"]["loadavg_1_5_15"]
    assert report["config"]["pairs"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharding_vs_torch_smoke_reports_every_ratio_key() -> None:
    # One configuration (two spawned runs) keeps it cheap; the others report None.
    report = _run("sharding_vs_torch.py", "--configs", "2r_bf16")
    assert set(SHARDING_KEYS) <= set(report)
    assert _is_spread(report["zero3_vs_fsdp2_step_time_bf16"])
    assert all(report[k] is None for k in SHARDING_KEYS if k != "zero3_vs_fsdp2_step_time_bf16")
    runs = report["results"]["2r_bf16"]
    assert set(runs) == {"fsdp2", "optim_grads_params"}
    assert report["conditions_before"]["loadavg_1_5_15"]
