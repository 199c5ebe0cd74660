"""`ckptctl` as a command line: help with examples, exit codes, one-line errors, helpers."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import time

import pytest
import structlog
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._format.dtypes import ITEM_SIZES, item_size
from ckpt_manager._format.pieces import Piece
from ckpt_manager.ctl.cli import main
from ckpt_manager.ctl.common import StorageFlags, nearest_steps
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.render import Progress, format_age, format_bytes
from ckpt_manager.ctl.sink import split_uri
from ckpt_manager.ctl.stream import as_flat_piece, chunk_ranges
from tests.support.s3 import S3Target

COMMANDS = ["list", "show", "verify", "restore", "prune", "pin", "unpin"]
CKPTCTL = str(pathlib.Path(sys.executable).with_name("ckptctl"))


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_shows_a_usage_example(
    command: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--help"] if command is None else [command, "--help"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    example = out.split("examples:", 1)[1]
    assert f"ckptctl {command or ''}".strip() in example


def test_console_script_help_is_fast_and_imports_no_torch() -> None:
    code = (
        "import sys; from ckpt_manager.ctl.cli import main; rc = main(['--help']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
    started = time.monotonic()
    out = subprocess.run([CKPTCTL, "--help"], check=True, capture_output=True, timeout=60)
    assert b"examples:" in out.stdout
    assert time.monotonic() - started < 20  # generous: the CI machine is shared


@pytest.mark.parametrize(
    "argv",
    [["list"], ["show"], ["verify"], ["prune", "--keep-last", "1", "--dry-run"], ["pin", "3"]],
    ids=lambda argv: argv[0],
)
def test_reading_manifests_imports_no_torch(argv: list[str], tmp_path: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="notorch") as mgr:
        mgr.save(3, {"w": torch.arange(4, dtype=torch.bfloat16), "step": 3}, metrics={"loss": 1.5})
    code = (
        "import sys; from ckpt_manager.ctl.cli import main; "
        f"rc = main({[argv[0], str(tmp_path), *argv[1:]]!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"3" in done.stdout


def test_logging_after_main_survives_a_closed_stderr(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # main() configures structlog; a manager logging later (another test, another caller)
    # must write to the stderr of that moment, not to the one main() saw.
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    assert main(["list", str(tmp_path)]) == 0
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    structlog.get_logger("ckpt_manager").warning("ckpt_after_main", ckpt_step=7)
    assert "ckpt_after_main" in second.getvalue()


def test_dtype_table_matches_torch() -> None:
    assert {
        name: value.itemsize
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype)
    } == ITEM_SIZES
    assert item_size("bfloat16") == 2
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        item_size("float33")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["list"],
        ["bogus", "x"],
        ["restore", "x"],  # --to is required
        ["restore", "x", "--to", "y", "--world-size", "2", "--format", "torch"],
        ["restore", "x", "--to", "y", "--world-size", "0"],
        ["list", "x", "--anon", "--profile", "p"],
        ["prune", "x", "--keep-best", "1"],
        ["show", "x", "abc"],
        ["list", "foo://bucket/x"],
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tmp_path) if a == "x" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error" in err


def test_unknown_scheme_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "foo://bucket/x"]) == 2
    assert "unknown URI scheme 'foo://'" in capsys.readouterr().err


def test_missing_path_and_bucket_exit_1(
    tmp_path: pathlib.Path, s3: S3Target, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip().endswith("no such file or directory")
    endpoint = ["--endpoint-url", s3.endpoint_url]
    assert main(["list", "s3://no-such-bucket/runs", *endpoint]) == 1
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
    assert main(["verify", f"{s3.uri}/no-prefix", *endpoint]) == 1
    assert "no such prefix in the bucket" in capsys.readouterr().err


def test_no_credentials_is_one_line(s3: S3Target, tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        HOME=str(tmp_path),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",  # never ask an instance-metadata endpoint
    )
    out = subprocess.run(
        [CKPTCTL, "list", f"{s3.uri}/runs", "--endpoint-url", s3.endpoint_url],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert "no usable AWS credentials" in out.stderr


def test_list_of_a_fresh_single_rank_root_end_to_end(tmp_path: pathlib.Path) -> None:
    root = str(tmp_path / "root")
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.ones(3) * step}, metrics={"loss": 1.0 / step})
            mgr.wait_until_finished()
    out = subprocess.run(
        [CKPTCTL, "list", root, "--keep-last", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert rows[0].split()[:3] == ["STEP", "STATE", "COMMITTED"]
    assert rows[1].split()[:2] == ["10", "committed"]
    assert rows[2].rstrip().endswith("latest,last-1")
    assert out.stderr == ""


def test_nearest_steps() -> None:
    assert nearest_steps([100, 200, 300, 1000], 250) == [100, 200, 300]
    assert nearest_steps([100, 200, 300, 1000], 900, count=2) == [300, 1000]
    assert nearest_steps([100, 200, 300, 1000], 5, count=2) == [100, 200]
    assert nearest_steps([], 5) == []


def test_storage_flags_only_apply_to_s3() -> None:
    flags = StorageFlags(endpoint_url="http://127.0.0.1:1", profile="p", region="eu-west-1")
    assert flags.options_for("/data/ckpt") == {}
    assert flags.options_for("s3://b/p") == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "eu-west-1"},
        "profile": "p",
    }
    with pytest.raises(UsageError, match="needs a scheme"):
        StorageFlags(endpoint_url="127.0.0.1:9000")


def test_split_uri() -> None:
    assert split_uri("s3://b/dir/model.pt") == ("s3://b/dir", "model.pt")
    assert split_uri("model.pt") == (".", "model.pt")
    assert split_uri("/abs/model.pt") == ("/abs", "model.pt")
    with pytest.raises(UsageError):
        split_uri("s3://bucket")


def test_as_flat_piece_accepts_contiguous_boxes_only() -> None:
    whole = Piece("f", 0, 96, (4, 6))
    assert as_flat_piece(whole, (4, 6)) is not None
    rows = Piece("f", 0, 48, (2, 6), global_offset=(2, 0))
    flat = as_flat_piece(rows, (4, 6))
    assert flat is not None
    assert flat.flat_range == (12, 24)
    cols = Piece("f", 0, 48, (4, 3), global_offset=(0, 3))
    assert as_flat_piece(cols, (4, 6)) is None
    row_part = Piece("f", 0, 12, (1, 3), global_offset=(2, 3))
    part = as_flat_piece(row_part, (4, 6))
    assert part is not None
    assert part.flat_range == (15, 18)


def test_chunk_ranges_cover_exactly() -> None:
    assert chunk_ranges(3, 20, 4, 32) == [(3, 11), (11, 19), (19, 20)]
    assert chunk_ranges(0, 0, 4, 32) == []


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_tty_only() -> None:
    tty = _Tty()
    bar = Progress(2048, 2, stream=tty)
    bar.advance(1024, 1)
    bar.advance(1024, 1)
    bar.close()
    assert "files 2/2" in tty.getvalue()
    assert "100.0%" in tty.getvalue()
    pipe = io.StringIO()
    quiet = Progress(10, 1, stream=pipe)
    quiet.advance(10, 1)
    quiet.close()
    assert pipe.getvalue() == ""


def test_formatting() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_age(59) == "59s"
    assert format_age(3 * 3600 + 120) == "3h02m"
    assert format_age(-4) == "0s"


def test_restore_draws_progress_on_a_tty_only(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "root")
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(1000)}})
        mgr.wait_until_finished()
    assert main(["restore", root, "--to", str(tmp_path / "a.pt")]) == 0
    assert "files" not in capsys.readouterr().err
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["restore", root, "--format", "safetensors", "--to", str(tmp_path / "b")]) == 0
    assert "files 1/1" in tty.getvalue()
    assert "100.0%" in tty.getvalue()
