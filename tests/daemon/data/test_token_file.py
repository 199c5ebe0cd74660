"""The token file format: `.bin` + JSON sidecar, validated when opened."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from daemon.data import read_info, write_token_file


def test_roundtrip_picks_the_dtype_from_the_vocabulary(tmp_path: Path) -> None:
    small = write_token_file(str(tmp_path / "a.bin"), [np.arange(10)], vocab_size=256)
    big = write_token_file(str(tmp_path / "b.bin"), [np.array([70_000, 1])], vocab_size=100_000)
    assert (small.dtype, small.num_tokens) == ("uint16", 10)
    assert big.dtype == "uint32"
    assert read_info(str(tmp_path / "a.bin")) == small
    assert np.array_equal(np.fromfile(tmp_path / "b.bin", dtype="<u4"), [70_000, 1])
    assert json.loads((tmp_path / "a.json").read_text())["vocab_size"] == 256


def test_bad_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        write_token_file(str(tmp_path / "x.bin"), [np.array([256])], vocab_size=256)
    (tmp_path / "raw.bin").write_bytes(b"\0" * 8)
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        read_info(str(tmp_path / "raw.bin"))
    write_token_file(str(tmp_path / "t.bin"), [np.arange(4)], vocab_size=256)
    with (tmp_path / "t.bin").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="sidecar says 4 uint16"):
        read_info(str(tmp_path / "t.bin"))
    (tmp_path / "t.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="bad token sidecar"):
        read_info(str(tmp_path / "t.bin"))
