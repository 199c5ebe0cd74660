"""`TokenDataset`: samples of seq_len + 1 tokens, local or fsspec, mixed by weight."""

from __future__ import annotations

import collections
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.data import TokenDataset, write_token_file
from daemon.data.reader import BlockCache
from daemon.rank.data import ShardedLoader
from tests.support.s3 import S3Target


def _file(root: str, name: str, tokens: np.ndarray, vocab: int = 1000) -> str:
    path = f"{root}/{name}.bin"
    write_token_file(path, [tokens], vocab_size=vocab)
    return path


def test_samples_are_windows_of_seq_len_plus_one(tmp_path: Path) -> None:
    path = _file(str(tmp_path), "a", np.arange(101))
    ds = TokenDataset([path], seq_len=10)
    assert len(ds) == 10
    x, y = ds[3]
    assert x.dtype == torch.int64
    assert torch.equal(x, torch.arange(30, 40))
    assert torch.equal(y, torch.arange(31, 41))
    with pytest.raises(IndexError):
        ds[10]


def test_many_files_on_an_fsspec_uri_concatenate(tmp_path: Path) -> None:
    root = f"memory://tokens-{uuid.uuid4().hex}"
    a = _file(root, "a", np.arange(0, 21))
    b = _file(root, "b", np.arange(500, 531), vocab=600)
    ds = TokenDataset([a, b], seq_len=5, block_bytes=8, cache_bytes=32)
    assert len(ds) == 4 + 6
    assert ds.vocab_size == 1000
    assert torch.equal(ds[4][0], torch.arange(500, 505))
    assert torch.equal(ds[9][1], torch.arange(526, 531))


def test_the_read_cache_stays_bounded_and_reads_only_ranges(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    cache = BlockCache(str(path), size=16384, block_bytes=1024, cache_bytes=4096)
    assert cache.read(1020, 1030) == (bytes(range(256)) * 64)[1020:1030]
    assert cache.num_requests == 2
    cache.read(1000, 1010)  # cached
    assert cache.num_requests == 2
    for start in range(0, 16384, 1024):
        cache.read(start, start + 1)
    assert cache.cached_bytes <= 4096
    with pytest.raises(ValueError, match="outside"):
        cache.read(16000, 17000)


def test_a_weighted_mixture_follows_the_weights(tmp_path: Path) -> None:
    a = _file(str(tmp_path), "a", np.zeros(401, dtype=np.int64))  # 100 samples of zeros
    b = _file(str(tmp_path), "b", np.ones(201, dtype=np.int64))  # 50 samples of ones
    ds = TokenDataset([a, b], seq_len=4, weights=[1.0, 3.0])
    assert len(ds) == 150
    drawn = collections.Counter(int(ds[i][0][0]) for i in range(len(ds)))
    assert abs(drawn[1] / len(ds) - 0.75) < 0.02
    # Within one source, the draws walk its samples in turn (wrapping when oversampled).
    locals_of_b = [ds.locate(i)[1] for i in range(len(ds)) if ds.locate(i)[0] == 1]
    assert locals_of_b[:50] == list(range(50))
    with pytest.raises(ValueError, match="weights must be > 0"):
        TokenDataset([a, b], seq_len=4, weights=[1.0, 0.0])


def test_the_loader_reads_token_files_at_any_world_size(tmp_path: Path) -> None:
    path = _file(str(tmp_path), "a", np.arange(641) % 1000)
    ds = TokenDataset([path], seq_len=8)
    single = ShardedLoader(ds, batch_size=4, rank=0, world_size=1, seed=1)
    pair = [ShardedLoader(ds, batch_size=2, rank=r, world_size=2, seed=1) for r in range(2)]
    for _ in range(3):
        assert torch.equal(single.next_batch()[0], torch.cat([p.next_batch()[0] for p in pair]))


def test_short_or_missing_sources_are_refused(tmp_path: Path) -> None:
    path = _file(str(tmp_path), "a", np.arange(5))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        TokenDataset([path], seq_len=8)
    with pytest.raises(FileNotFoundError):
        TokenDataset([str(tmp_path / "none.bin")], seq_len=8)
    with pytest.raises(ValueError, match="at least one"):
        TokenDataset([], seq_len=8)


def test_s3_sources_are_read_by_ranges(s3: S3Target) -> None:
    # s3fs's cat_file takes (path, version_id, start, end): ranges must be passed by keyword.
    path = f"{s3.uri}/tokens/a.bin"
    write_token_file(
        path, [np.arange(4001) % 1000], vocab_size=1000, storage_options=s3.storage_options
    )
    ds = TokenDataset([path], seq_len=100, storage_options=s3.storage_options, block_bytes=256)
    assert torch.equal(ds[7][0], torch.arange(700, 800))
    assert torch.equal(ds[39][1], torch.arange(3901, 4001) % 1000)
