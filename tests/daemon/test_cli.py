"""`trainingd` command line hygiene: no flag abbreviations, a torch-free --help/--version."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.observe.incidents import INCIDENTS_FILE, IncidentKind, IncidentLog
from daemon.observe.report import default_url
from daemon.rundir.snapshot import SNAPSHOT_SCHEMA, snapshot_path, write_snapshot


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


def test_the_module_form_runs_the_cli_in_a_plain_checkout() -> None:
    # What `DaemonProc` (and the recovery bench through it) runs where the console script is
    # not installed: the device machine's plain checkout (BENCHMARKS.md "The next device run").
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--version"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("trainingd "), out.stdout


def test_status_with_nothing_listening_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert main(["status", "--url", url]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"trainingd: no daemon answers at {url} (is it running? use --url or --run-dir)\n"
    # The default URL comes from the configuration (here its variables).
    monkeypatch.setenv("TRAININGD_METRICS_PORT", str(port))
    assert main(["status"]) == 1
    assert f"no daemon answers at {url} " in capsys.readouterr().err
    monkeypatch.setenv("TRAININGD_METRICS_PORT", "0")
    assert main(["status"]) == 1
    assert "metrics_port is 0" in capsys.readouterr().err


def test_status_reads_a_run_directory_when_the_daemon_is_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--run-dir", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err == f"trainingd: no run directory at {tmp_path / 'none'}\n"
    assert main(["status", "--run-dir", str(tmp_path)]) == 1
    assert "holds no rank snapshots" in capsys.readouterr().err
    (tmp_path / "ranks").mkdir()
    gauges = {
        "trainingd_train_step": {"": 12.0},
        "trainingd_ckpt_last_committed_step": {"": 10.0},
        "trainingd_memory_newest_step": {"": 12.0},
    }
    for k in (0, 1):
        snapshot = {"schema": SNAPSHOT_SCHEMA, "pid": 5 + k, "rank": k, "world_size": 2}
        snapshot |= {"restart": 1, "phase": "finished", "counters": {}, "gauges": gauges}
        write_snapshot(snapshot_path(tmp_path, k), {**snapshot, "histograms": {}})
    incidents = IncidentLog(node=0, path=tmp_path / INCIDENTS_FILE)
    incidents.open(IncidentKind.RANK_FAILURE, ranks=[1], cause="rank 1 (node 0): killed by SIGKILL")
    incidents.restarted(unix_s=time.time(), restored_step=9, source="memory")
    incidents.open(IncidentKind.HANG, ranks=[0], cause="still open: not in the file")
    capsys.readouterr()  # the log lines of the incidents above
    assert main(["status", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "phase offline" in out
    assert "step 12" in out
    assert "newest durable step 10, newest memory step 12" in out
    row = next(line.split() for line in out.splitlines() if "rank_failure" in line)
    assert row[:5] == ["1", "rank_failure", "rank", "1", "node"]
    assert "memory" in row
    assert "recovered" in row
    assert "still open" not in out
    assert main(["status", "--run-dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(i["id"], i["source"]) for i in data["incidents"]] == [(1, "memory")]


def test_the_default_status_url_is_the_configured_metrics_endpoint() -> None:
    assert default_url("127.0.0.1", 9464) == "http://127.0.0.1:9464"
    assert default_url("0.0.0.0", 9464) == "http://127.0.0.1:9464"
    assert default_url("::1", 9464) == "http://[::1]:9464"
