"""`TokenDataset`: samples of `seq_len + 1` tokens from one or many token files, mixed by weight.

Sample `i` of a file is tokens `[i*T, i*T + T + 1)` (`T = seq_len`): inputs are the first `T`,
targets the last `T`, and consecutive samples share one boundary token, exactly as the default
job's `ByteCorpus`. A file of `N` tokens holds `(N - 1) // T` samples.

[Note: how sources are mixed]
Without weights the sources are concatenated: an epoch sees every sample of every file once
(in the loader's shuffled order). With weights, an epoch has as many samples as all sources
together, laid out in periods of `PERIOD` slots; each source owns a share of the slots
proportional to its weight (largest remainder, at least one slot per source, spread out by
smooth weighted round robin), and its `k`-th draw is its sample `k mod len(source)`. A source
drawn more often than its size repeats within the epoch; one drawn less often contributes its
first samples. The mapping is a table of `PERIOD` slots: O(1) in the sample count, like the
loader's permutation, so 10^9 samples cost nothing to index.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from daemon.data.reader import BlockCache
from daemon.data.token_file import DTYPES, TokenFileInfo, read_info

__all__ = ["PERIOD", "TokenDataset"]

PERIOD = 1000
"""Slots of one period of a weighted mixture (see [Note: how sources are mixed])."""


def _slot_table(weights: Sequence[float]) -> tuple[list[int], list[int], list[int]]:
    """Per slot: its source and the source's draw number in the period; per source: its slots."""
    total = float(sum(weights))
    exact = [w / total * PERIOD for w in weights]
    counts = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: exact[s] - int(exact[s]), reverse=True)
    for s in by_remainder:
        if sum(counts) >= PERIOD:
            break
        counts[s] += 1
    while sum(counts) > PERIOD:  # the at-least-one floor overshot: take from the largest
        counts[counts.index(max(counts))] -= 1
    # Smooth weighted round robin: each slot goes to the source furthest behind its share.
    credit = [0] * len(counts)
    drawn = [0] * len(counts)
    source_of, draw_of = [], []
    for _ in range(PERIOD):
        for s, c in enumerate(counts):
            credit[s] += c
        s = max(range(len(counts)), key=lambda k: credit[k])
        credit[s] -= PERIOD
        source_of.append(s)
        draw_of.append(drawn[s])
        drawn[s] += 1
    return source_of, draw_of, counts


class TokenDataset:
    """Samples of `seq_len + 1` tokens from token files (local paths or fsspec URIs).

    A `daemon.jobs.job.Dataset`: `len()` and `[i] -> (inputs, targets)`, int64 tensors of
    `seq_len` tokens. Files are read by ranges through a bounded cache per file
    (`daemon/data/reader.py`), so S3 files are never downloaded whole.

    Args:
        sources: token files (`.bin` with a `.json` sidecar, see `daemon/data/token_file.py`).
        seq_len: tokens per sample's inputs (`T`).
        weights: one weight per source for a mixture (see [Note: how sources are mixed]);
            None concatenates them.
        storage_options: fsspec options (e.g. an S3 endpoint): one dict for every source, or
            a function of the source's URI (sources on different filesystems).
        cache_bytes: the read cache per source.
        block_bytes: the read unit of that cache.

    Raises:
        FileNotFoundError: a source or its sidecar is missing.
        ValueError: no source, a bad weight, a file too short for one sample.
    """

    def __init__(
        self,
        sources: Sequence[str],
        *,
        seq_len: int,
        weights: Sequence[float] | None = None,
        storage_options: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None,
        cache_bytes: int = 32 << 20,
        block_bytes: int = 1 << 20,
    ) -> None:
        if not sources:
            raise ValueError("TokenDataset needs at least one source")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if weights is not None:
            if len(weights) != len(sources):
                raise ValueError(f"{len(weights)} weights for {len(sources)} sources")
            if any(not w > 0 for w in weights):
                raise ValueError(f"weights must be > 0, got {list(weights)}")
        self.seq_len = seq_len
        """Tokens per sample's inputs."""
        options = [
            storage_options(s) if callable(storage_options) else (storage_options or {})
            for s in sources
        ]
        self.infos: list[TokenFileInfo] = [
            read_info(s, o) for s, o in zip(sources, options, strict=True)
        ]
        """Each source's sidecar."""
        self._lens = [(info.num_tokens - 1) // seq_len for info in self.infos]
        for source, n in zip(sources, self._lens, strict=True):
            if n < 1:
                raise ValueError(f"{source}: fewer than seq_len + 1 = {seq_len + 1} tokens")
        self._readers = [
            BlockCache(
                source,
                size=info.num_tokens * info.itemsize,
                block_bytes=block_bytes,
                cache_bytes=cache_bytes,
                storage_options=o,
            )
            for source, info, o in zip(sources, self.infos, options, strict=True)
        ]
        self._total = sum(self._lens)
        self._offsets = [0]
        for n in self._lens:
            self._offsets.append(self._offsets[-1] + n)
        self._mixture = _slot_table(weights) if weights is not None else None

    @property
    def vocab_size(self) -> int:
        """The largest vocabulary of the sources (token ids are below it)."""
        return max(info.vocab_size for info in self.infos)

    def __len__(self) -> int:
        """Samples in one epoch (all sources together)."""
        return self._total

    def locate(self, index: int) -> tuple[int, int]:
        """`(source, sample within that source)` of sample `index`."""
        if not 0 <= index < self._total:
            raise IndexError(f"sample {index} is outside [0, {self._total})")
        if self._mixture is None:
            source = bisect.bisect_right(self._offsets, index) - 1
            return source, index - self._offsets[source]
        source_of, draw_of, counts = self._mixture
        period, slot = divmod(index, PERIOD)
        source = source_of[slot]
        return source, (period * counts[source] + draw_of[slot]) % self._lens[source]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(inputs, targets)` of sample `index`: int64 tensors of `seq_len` tokens."""
        source, local = self.locate(index)
        info = self.infos[source]
        start = local * self.seq_len * info.itemsize
        raw = self._readers[source].read(start, start + (self.seq_len + 1) * info.itemsize)
        tokens = torch.from_numpy(np.frombuffer(raw, dtype=DTYPES[info.dtype]).astype(np.int64))
        return tokens[:-1], tokens[1:]
