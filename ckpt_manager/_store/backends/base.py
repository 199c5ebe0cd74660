"""The storage backend seam: what the engine needs from a store, and what it may ask of one.

[Note: the backend contract] Every operation the engine performs on a checkpoint root goes
through `Storage` (`_store/storage.py`), which validates names, joins them to the root and
translates errors; a `StorageBackend` does the store-specific part on the resulting paths.
What a backend must guarantee, whatever the store:

* Atomic publish. `write` and `put_file` make an object appear whole or not at all: a
  reader never sees a prefix of it, and a failed write (an exception from either) publishes
  nothing under the name (a partial upload is aborted, a temporary removed).
* Exclusive create. `write(..., exclusive=True)` and `put_file(..., exclusive=True)` fail
  with `FileExistsError` (or `ObjectExistsError`) when the name exists and leave it as it
  was. Whether two racing creators are decided by the store or by a check that another
  process can slip between is `Capabilities.race_free_exclusive_create` (for `write`).
* Conditional replace. `read_with_version` returns the content and a version token;
  `write_if` publishes new content only while the object is still at that version (or,
  for None, only while it is absent) and raises `VersionMismatchError` otherwise. A
  version identifies content: writing the same bytes keeps it.
  `Capabilities.race_free_conditional_write` says whether that holds against racers in
  other processes too.
* Reads: whole objects or a byte range `[start, end)`; `read_many` reads a batch and
  returns each object's bytes or the exception its read raised, in order, never failing
  the batch for one bad name; `read_into` reads a range into the caller's writable buffer
  and returns the count, short only where the object ends.
* Listing and metadata: the direct children of a folder (sorted names, empty when the
  folder does not exist), never served from a stale cache (another process wrote them);
  size, existence, modification time (of an object, or of the newest object anywhere
  under a folder).
* Deletion: one object, or a folder with everything under it; missing is fine.
* Moving a folder (`move_tree`, quarantine of a corrupt step): atomic where the store
  renames folders; elsewhere copies first and removes the source only once every object is
  copied, so a move cut short never loses an object.
* `abort_uploads`: abort incomplete uploads a killed writer left under a folder (stores
  without such uploads return 0).

Errors: a backend raises what its store raised (`OSError` and subclasses, botocore errors)
or an `errors.py` class; `Storage` translates the rest at the edge (`backend_errors.py`).
Missing objects are `FileNotFoundError`.

`Capabilities` is what callers used to infer from the protocol name: they ask it instead
(an ast test, `tests/ckpt_manager/store/test_backend_seam.py`, keeps protocol names inside
`_store/backends/`).
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["BackendFactory", "Capabilities", "StorageBackend"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class Capabilities:
    """What a store can do and what suits it; callers ask these, never the protocol."""

    local_paths: bool
    """Names are files on this host's POSIX filesystem: `Storage.path(name)` is a real path
    a caller may open, and a temporary file beside it is on the same disk."""
    remote: bool
    """Every operation is a request over the network to a server (an object store):
    transient failures (unreachable, timeouts, throttling, 5xx) are worth waiting out
    (`Storage.retrying`), and latency-bound reads worth running concurrently."""
    progressive_write: bool
    """`write(..., staged=...)` writes each part as it becomes final, so the write overlaps
    the producer; False: the store takes the buffer only after the last count, so handing
    a write over before its bytes are final gains nothing."""
    read_prefetch: int
    """Ranged reads a streaming reader should keep in flight ahead of the one it consumes
    (0: read inline, one at a time)."""
    read_concurrency: int
    """Independent small reads (existence probes, manifests) worth running at once (1: one
    after another)."""
    race_free_exclusive_create: bool
    """`write(..., exclusive=True)` is decided by the store itself: of racing creators in any
    processes exactly one wins. False: a check then a write, which a creator in another
    process can slip between (the lease keeps two runs from committing to one root)."""
    race_free_conditional_write: bool
    """`write_if` is decided atomically against racers in any process (an S3 conditional
    PUT, an `flock`). False: check-then-write under a lock of this process only."""
    shared_across_processes: bool
    """Another process opening the same URI sees what this one wrote (False for
    `memory://`, which lives in this process: writer processes cannot use it)."""

    def __post_init__(self) -> None:
        if self.read_prefetch < 0:
            raise ValueError(f"read_prefetch={self.read_prefetch}: use 0 (no prefetch) or more")
        if self.read_concurrency < 1:
            raise ValueError(f"read_concurrency={self.read_concurrency}: use 1 or more")


class StorageBackend(Protocol):
    """One checkpoint root on one store. See [Note: the backend contract].

    Paths are the store's own (`root` joined with a validated relative name by `Storage`);
    a backend never sees a name that escapes its root.
    """

    @property
    def root(self) -> str:
        """The root as the store's own path (no trailing `/`, but `/` itself)."""
        ...

    @property
    def location(self) -> str:
        """The root as a canonical URL (`file:///data/ckpt`, `s3://bucket/run`): two
        backends with the same location are the same root."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this store can do (see `Capabilities`)."""
        ...

    def write(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        *,
        exclusive: bool,
        chunk_bytes: int,
        concurrency: int,
        staged: Iterable[int] | None,
    ) -> None:
        """Publish `data` as `path`, atomically.

        Args:
            path: the object.
            data: the bytes (any contiguous buffer; not copied where the store allows).
            exclusive: fail with `FileExistsError` if `path` exists.
            chunk_bytes: part size of a multipart upload, where the store has them.
            concurrency: parts in flight at once, where the store has them.
            staged: `data` is still being filled: increasing counts of its final leading
                bytes, ending with `len(data)`; the backend must consume all of it.
        """
        ...

    def put_file(
        self, local_path: str, path: str, *, exclusive: bool, chunk_bytes: int, concurrency: int
    ) -> None:
        """Publish the finished local file `local_path` as `path`, atomically, streamed
        (never held in memory whole); `local_path` may be consumed.

        Args:
            local_path: the file.
            path: the object.
            exclusive: fail with `FileExistsError` if `path` exists (a check, then the
                upload, on stores without a conditional upload).
            chunk_bytes: part size of a multipart upload, where the store has them.
            concurrency: parts in flight at once, where the store has them.
        """
        ...

    def read(self, path: str, start: int | None, end: int | None) -> bytes:
        """The object's bytes, or bytes `[start, end)` of it."""
        ...

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Read bytes `[start, start + len(out))` of the object into `out` (a writable
        contiguous buffer: no intermediate copy where the store allows); the count read,
        short only where the object ends."""
        ...

    def read_many(self, paths: list[str]) -> list[bytes | Exception]:
        """Whole objects in one batch (concurrent where the store allows): each one's bytes
        or the exception its read raised, in order."""
        ...

    def read_with_version(self, path: str) -> tuple[bytes, str]:
        """The whole object and the version token `write_if` compares against."""
        ...

    def write_if(self, path: str, data: bytes, *, expected_version: str | None) -> str:
        """Replace the object only while it is at `expected_version` (None: create it only
        while absent); returns the new version.

        Raises:
            VersionMismatchError: the object is at another version, exists or is gone.
        """
        ...

    def size(self, path: str) -> int:
        """Size in bytes of an object."""
        ...

    def exists(self, path: str) -> bool:
        """Whether an object or a folder exists."""
        ...

    def list_names(self, path: str) -> list[str]:
        """Sorted names of the direct children of a folder (empty if it does not exist)."""
        ...

    def modified_unix_s(self, path: str) -> float | None:
        """Modification time of an object, or of the newest object anywhere under a folder;
        None if it does not exist (or the store keeps no times)."""
        ...

    def remove(self, path: str) -> None:
        """Delete one object; a missing object is fine."""
        ...

    def remove_tree(self, path: str) -> None:
        """Delete a folder and everything under it; a missing folder is fine."""
        ...

    def move_tree(self, src: str, dst: str) -> None:
        """Move a folder and everything under it to `dst` (which must not exist): one
        atomic rename where the store has folders (local disk); elsewhere every object is
        copied (server-side where the store can) and the source removed once all are."""
        ...

    def abort_uploads(self, path: str, *, older_than_s: float) -> int:
        """Abort incomplete uploads under a folder started at least `older_than_s` ago (an
        upload of unknown age counts as old); returns how many. 0 on stores without
        resumable uploads."""
        ...

    def describe_missing_root(self) -> str:
        """Why the root does not exist, in words an operator can act on (the bucket is
        missing, or the prefix is empty); never raises."""
        ...

    def keep_buffer(self, buffer: mmap.mmap) -> bool:
        """Make repeated `write`s from the mapping `buffer` cheaper where the store can (local
        disk pins its pages once for direct writes); whether it did. The caller owns the
        mapping and calls `release_buffer` before unmapping it."""
        ...

    def release_buffer(self, buffer: mmap.mmap) -> None:
        """Undo `keep_buffer` for `buffer` (a no-op if it was not kept)."""
        ...


class BackendFactory(Protocol):
    """What the registry holds (`backends/__init__.py`): a backend class, which names the
    URI schemes it serves and opens a root."""

    @property
    def name(self) -> str:
        """The backend's name in the registry and the contract suite (`local`, `s3`)."""
        ...

    @property
    def schemes(self) -> tuple[str, ...]:
        """URI schemes it serves (`s3`, `s3a`); the fallback serves every other one."""
        ...

    def open(self, root_uri: str, storage_options: Mapping[str, Any]) -> StorageBackend:
        """The backend for `root_uri`.

        Raises:
            ValueError: the URI cannot be opened by this backend.
        """
        ...

    def probe(self, root_uri: str, storage_options: Mapping[str, Any], *, timeout_s: float) -> None:
        """Start-up check that `root_uri` can take a checkpoint, answered within about
        `timeout_s` (a tool checks this before it starts work that would fail later).

        Raises:
            StorageError: one line an operator can act on (the folder is not writable, the
                endpoint does not answer, the bucket does not exist).
            ValueError: the URI cannot be opened by this backend.
        """
        ...
