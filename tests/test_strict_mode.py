"""Missing system tools: a clear skip by default, a failure in strict mode (tests/conftest.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import STRICT_VARIABLE

REPO = pathlib.Path(__file__).resolve().parents[1]
REASON = "promtool and prometheus not on PATH: install Debian's `prometheus` package"


def _pytest_without_promtool(
    tmp_path: pathlib.Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """`pytest` on one promtool test, in a subprocess whose PATH holds no promtool/prometheus."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    clean = {
        k: v for k, v in os.environ.items() if k not in ("CI", STRICT_VARIABLE, "PYTEST_ADDOPTS")
    }
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    argv += ["tests/dashboards/test_rules.py", "-k", "test_promtool_check_rules"]
    return subprocess.run(
        argv,
        cwd=REPO,
        env={**clean, "PATH": str(empty_bin), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_missing_promtool_skips_with_the_reason(tmp_path: pathlib.Path) -> None:
    out = _pytest_without_promtool(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout, out.stdout
    assert f"`prometheus` tests will skip: {REASON}" in out.stdout  # the header line
    assert "SKIPPED [1] " in out.stdout  # the -ra summary


@pytest.mark.parametrize("env", [{STRICT_VARIABLE: "1"}, {"CI": "true"}], ids=["strict", "ci"])
def test_strict_mode_turns_the_skip_into_a_failure(
    tmp_path: pathlib.Path, env: dict[str, str]
) -> None:
    out = _pytest_without_promtool(tmp_path, **env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 error" in out.stdout, out.stdout  # failed in setup: an error, exit status 1
    assert "skipped" not in out.stdout
    assert "strict mode: no skip" in out.stdout
