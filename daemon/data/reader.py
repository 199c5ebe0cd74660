"""Range reads of one file through a bounded cache of aligned blocks.

A sample of a token file is a few kilobytes somewhere in a file of gigabytes: on S3 each read
is one ranged GET. Reads are rounded out to aligned blocks (`block_bytes`), and the most recent
blocks are kept in an LRU bounded by `cache_bytes`, so neighbouring samples and the `+1` token
that overlaps the next sample cost no second request, and memory stays bounded whatever the
file's size. Local files go through the same path (fsspec's local filesystem), which keeps one
code path and costs a `pread` per block.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import fsspec

__all__ = ["BlockCache"]


class BlockCache:
    """`read(start, end)` of one file (path or fsspec URI) through an LRU of aligned blocks.

    Thread-safe: the prefetcher and the training thread may read at once.

    Args:
        uri: the file.
        size: its size in bytes (known from the sidecar; saves a request).
        block_bytes: the read unit.
        cache_bytes: the most bytes of blocks kept (at least one block).
        storage_options: fsspec options (e.g. the S3 endpoint).
    """

    def __init__(
        self,
        uri: str,
        *,
        size: int,
        block_bytes: int = 1 << 20,
        cache_bytes: int = 32 << 20,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self._fs, self._path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        self._size = size
        self._block = block_bytes
        self._max_blocks = max(1, cache_bytes // block_bytes)
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_requests = 0
        """Blocks read from storage so far (cache misses)."""

    def _block_at(self, index: int) -> bytes:
        with self._lock:
            hit = self._blocks.get(index)
            if hit is not None:
                self._blocks.move_to_end(index)
                return hit
        start = index * self._block
        data = bytes(
            self._fs.cat_file(self._path, start=start, end=min(start + self._block, self._size))
        )
        with self._lock:
            self.num_requests += 1
            self._blocks[index] = data
            while len(self._blocks) > self._max_blocks:
                self._blocks.popitem(last=False)
        return data

    def read(self, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of the file.

        Raises:
            ValueError: the range is outside the file.
        """
        if not 0 <= start <= end <= self._size:
            raise ValueError(f"range [{start}, {end}) is outside the file (size {self._size})")
        parts = []
        for index in range(
            start // self._block, (end - 1) // self._block + 1 if end > start else 0
        ):
            block = self._block_at(index)
            base = index * self._block
            parts.append(block[max(start - base, 0) : min(end - base, len(block))])
        return b"".join(parts)

    @property
    def cached_bytes(self) -> int:
        """Bytes of blocks held now (at most `cache_bytes`, or one block)."""
        with self._lock:
            return sum(len(b) for b in self._blocks.values())
