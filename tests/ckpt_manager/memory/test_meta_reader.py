"""`MetaReader`: a slot directory's complete metas, each file version parsed once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_manager._memory import meta_reader
from ckpt_manager._memory.meta import MetaEncoder, ParsedMeta, parse_meta_file
from ckpt_manager._memory.meta_reader import MetaReader
from ckpt_manager._memory.slots import SlotFiles
from tests.ckpt_manager.memory.test_meta import _encode, _plan


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bytes of every meta the reader parses."""
    seen: list[bytes] = []

    def counting(data: bytes) -> ParsedMeta:
        seen.append(data)
        return parse_meta_file(data)

    monkeypatch.setattr(meta_reader, "parse_meta_file", counting)
    return seen


def _write(files: SlotFiles, slot: int, step: int) -> bytes:
    data = _encode(MetaEncoder(), _plan(3), step)
    files.write_meta(slot, data)
    return data


def test_each_version_is_parsed_once_and_a_replaced_meta_again(
    tmp_path: Path, parses: list[bytes]
) -> None:
    files = SlotFiles(str(tmp_path), 1)
    reader = MetaReader()
    first = _write(files, 0, 5)
    _write(files, 1, 6)
    assert {k: p.meta.step for k, p in reader.complete(files).items()} == {0: 5, 1: 6}
    assert {k: p.meta.step for k, p in reader.complete(files).items()} == {0: 5, 1: 6}
    assert len(parses) == 2
    assert reader.complete(files)[0].data == first

    _write(files, 0, 7)  # slot 0 taken again: a new file (rename), parsed again
    assert {k: p.meta.step for k, p in reader.complete(files).items()} == {0: 7, 1: 6}
    assert len(parses) == 3
    files.remove_meta(1)
    assert list(reader.complete(files)) == [0]
    # Another rank in the same directory is its own.
    assert reader.complete(SlotFiles(str(tmp_path), 2)) == {}


def test_a_meta_that_does_not_verify_is_left_out_until_it_is_replaced(
    tmp_path: Path, parses: list[bytes]
) -> None:
    files = SlotFiles(str(tmp_path), 1)
    reader = MetaReader()
    data = bytearray(_write(files, 0, 5))
    data[data.index(b'"step":5') + 7] = ord("6")
    with open(files.meta_path(0), "r+b") as f:  # in place: same inode, its mtime moves on
        f.write(data)
    os.utime(files.meta_path(0), ns=(1, 1))  # even with an mtime that went back
    assert reader.complete(files) == {}
    assert reader.complete(files) == {}
    assert len(parses) == 1  # the broken version is remembered as broken
    _write(files, 0, 8)
    assert reader.complete(files)[0].meta.step == 8


def test_a_meta_the_caller_wrote_is_remembered_without_a_parse(
    tmp_path: Path, parses: list[bytes]
) -> None:
    files = SlotFiles(str(tmp_path), 1)
    reader = MetaReader()
    written = parse_meta_file(_encode(MetaEncoder(), _plan(3), 5))
    files.write_meta(0, written.data)
    reader.remember(files, 0, written)
    assert reader.complete(files) == {0: written}
    assert parses == []
    _write(files, 0, 6)  # then replaced by another writer: read as usual
    assert reader.complete(files)[0].meta.step == 6
    assert len(parses) == 1
