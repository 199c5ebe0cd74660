"""`bench/ckpt_scale.py --quick --json` stays runnable: one JSON object with the issue's keys,
measured figures that hang together, and the PNG plot written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "ckpt_scale.py"
KEYS = {
    "manifest_bytes_1024",
    "commit_cpu_s_1024",
    "finalize_p99_ms",
    "restore_read_ratio",
    "list_10k_s",
    "list_10k_requests",
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_json_has_the_issues_keys_and_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "scale.png"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", "--backends=memory", f"--plot={plot}"],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # one object, alone on stdout
    assert doc.keys() >= KEYS | {"saves", "lists", "conditions", "targets"}
    assert set(doc["conditions"]) == {"before", "after"}
    # --quick runs 8 and 64 ranks and 200 steps: the 1024-rank and 10k-step keys are null.
    assert [s["ranks"] for s in doc["saves"]] == [8, 64]
    assert doc["manifest_bytes_1024"] is None
    assert doc["list_10k_s"] is None
    assert doc["format"].startswith("format 2")
    small, large = doc["saves"]
    # Format 2: the top manifest barely grows with the ranks (one index entry per rank).
    assert small["manifest_bytes"] < large["manifest_bytes"] < 2 * small["manifest_bytes"]
    assert large["save_requests"] > small["save_requests"]
    for save in doc["saves"]:  # bytes, counted: one rank reads its share, not everyone's
        assert save["restore_read_bytes"] >= save["restore_own_bytes"] > 0
        assert save["restore_read_ratio"] <= 2.0
    # Measured on real ranks: every counted call's wall time bounds its CPU time.
    finalize = doc["finalize"]
    assert finalize["ranks"] == 2
    assert finalize["calls"] > 0
    assert doc["finalize_p99_ms"] == finalize["p99_ms"] >= finalize["p50_ms"] > 0
    assert 0 < finalize["cpu_p50_ms"] <= finalize["p99_ms"]
    assert doc["commit_wall_p99_ms"] > 0
    (listed,) = doc["lists"]
    assert listed["steps"] == 200
    assert listed["repaired_catalog"] is True
    assert listed["list_requests"] < 20 < listed["list_without_catalog_requests"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
