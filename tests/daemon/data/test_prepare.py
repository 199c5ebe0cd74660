"""`trainingd prepare-data`: text files to a token file, bytes or a local tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from daemon.cli import main
from daemon.data import TokenDataset, read_info


def test_bytes_of_every_input_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b.txt").write_bytes("wörld\n".encode())
    out = str(tmp_path / "out.bin")
    assert (
        main(["prepare-data", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out", out]) == 0
    )
    assert "13 tokens (uint16, vocabulary 256)" in capsys.readouterr().out
    assert bytes(np.fromfile(out, dtype="<u2").astype(np.uint8)) == "hello wörld\n".encode()
    assert read_info(out).vocab_size == 256
    assert len(TokenDataset([out], seq_len=4)) == 3


def test_a_local_tokenizer_file_encodes_the_text(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "t.txt").write_text("hello world\nworld zzz hello\n")
    out = str(tmp_path / "t.bin")
    argv = [str(tmp_path / "t.txt"), "--out", out, "--tokenizer", str(tmp_path / "tok.json")]
    assert main(["prepare-data", *argv]) == 0
    assert np.fromfile(out, dtype="<u2").tolist() == [1, 2, 2, 0, 1]
    assert read_info(out).vocab_size == 3


def test_a_missing_input_is_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["prepare-data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o.bin")]) == 2
    assert "none.txt" in capsys.readouterr().err


def test_python_dash_m_runs_the_same_command(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"abc")
    out = tmp_path / "o.bin"
    done = subprocess.run(
        [sys.executable, "-m", "daemon.data.prepare", str(tmp_path / "a.txt"), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size == 6
