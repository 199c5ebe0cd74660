"""Packaging facts: the three packages, their public surfaces, console scripts."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent


def test_daemon_is_our_package_not_python_daemon() -> None:
    import daemon

    assert pathlib.Path(daemon.__file__).resolve().parent == REPO / "daemon"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("python-daemon")


@pytest.mark.parametrize(
    ("package", "expected"),
    [
        (
            "daemon",
            [
                "GPT",
                "Block",
                "DaemonConfig",
                "Dataset",
                "GPTConfig",
                "JobContext",
                "JobSpec",
                "LogFormat",
                "bind_process_context",
                "configure_logging",
                "lm_loss",
                "load_config",
            ],
        ),
    ],
)
def test_public_surface_is_pinned(package: str, expected: list[str]) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(expected)
    for name in module.__all__:
        assert getattr(module, name).__doc__, f"{package}.{name} has no docstring"


def test_engines_do_not_import_each_other_or_the_daemon() -> None:
    forbidden = {
        "sharding": ("ckpt_manager", "daemon"),
        "ckpt_manager": ("sharding", "daemon"),
    }
    for package, banned in forbidden.items():
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            for other in banned:
                assert f"import {other}" not in text, f"{path} imports {other}"
                assert f"from {other}" not in text, f"{path} imports {other}"


@pytest.mark.parametrize("script", ["trainingd", "ckptctl"])
def test_console_scripts_answer_help_and_version(script: str) -> None:
    exe = BIN / script
    assert exe.exists(), f"{exe} missing: is the package installed in this venv?"
    help_out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    assert "usage:" in help_out.stdout
    assert "examples:" in help_out.stdout
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert ver.stdout.strip() == f"{script} {importlib.metadata.version('trainingd')}"
