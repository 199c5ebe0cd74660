"""`trainingd` command line hygiene: no flag abbreviations, a torch-free --help/--version."""

from __future__ import annotations

import subprocess
import sys

import pytest

from daemon.cli import main


@pytest.mark.parametrize("argv", [["run"], ["config", "show"]], ids=["run", "config-show"])
def test_a_prefix_of_a_flag_is_a_usage_error_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse's default allow_abbrev=True would silently take --max-step for --max-steps.
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--max-step", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-step 3" in err
    assert "did you mean --max-steps?" in err


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("daemon.cli", ["--help"]),
        ("daemon.cli", ["--version"]),
        ("daemon.cli", ["run", "--help"]),
        ("ckpt_manager.ctl.cli", ["--version"]),
    ],
    ids=["trainingd-help", "trainingd-version", "trainingd-run-help", "ckptctl-version"],
)
def test_help_and_version_import_no_torch(module: str, argv: list[str]) -> None:
    # Structural, not timed: torch is what makes a console script slow to answer (~2 s).
    code = (
        f"import sys; from {module} import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
