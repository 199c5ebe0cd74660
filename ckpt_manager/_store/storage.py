"""The storage front: one `Storage` per checkpoint root, over the backend that serves it.

`Storage(root_uri, options)` opens the root with the backend registered for its scheme
(`_store/backends/`: local disk, S3, any other fsspec filesystem such as `memory://`) and
exposes a handful of operations on names relative to the root. It does what every store
needs the same way:

* Names are validated (`_format/names.validate_relative_name`: no `..`, no absolute paths)
  and joined to the root; a backend never sees a name that escapes it.
* Every backend error leaves as a `StorageError` subclass (`backend_errors.translated`,
  see `errors.py`).
* Transient failures of remote stores can be waited out (`retrying`, [Note: a store outage
  is waited out, not failed] in `_save/writer.py`).
* `capabilities` says what the store can do and what suits it (a real local path, remote,
  prefetch depth, race-free conditions, shared across processes): callers ask it, never
  the protocol. What each backend guarantees is [Note: the backend contract] in
  `_store/backends/base.py`; store quirks live in the backend modules and nowhere else.
"""

from __future__ import annotations

import mmap
import posixpath
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from ckpt_manager._format.names import validate_relative_name
from ckpt_manager._store.backend_errors import is_transient, storage_error, translated
from ckpt_manager._store.backends import Capabilities, StorageBackend, open_backend
from ckpt_manager.errors import CheckpointError

__all__ = ["Storage"]

_MAX_RETRY_DELAY_S = 30.0
_T = TypeVar("_T")


class Storage:
    """A checkpoint root on some store, addressed by names relative to it."""

    def __init__(self, root_uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
        """Resolve the root.

        Args:
            root_uri: local path, `file://...`, `s3://bucket/prefix`, `memory://...`, ...
            storage_options: fsspec options (e.g. `client_kwargs={"endpoint_url": ...}`).

        Raises:
            ValueError: the URI cannot be resolved to a filesystem.
        """
        self.root_uri = root_uri
        """The root as given."""
        self.storage_options = dict(storage_options or {})
        """fsspec options, as given."""
        self.backend: StorageBackend = open_backend(root_uri, self.storage_options)
        """The backend serving the root (`_store/backends/`)."""
        self.capabilities: Capabilities = self.backend.capabilities
        """What the store can do and what suits it (ask this, never the protocol)."""

    def __repr__(self) -> str:
        return f"Storage({self.root_uri!r})"

    @property
    def root(self) -> str:
        """The root as the store's own path."""
        return self.backend.root

    def same_root_as(self, other: Storage) -> bool:
        """Whether `other` is this very root (same store, same path), however it was named."""
        return self.backend.location == other.backend.location

    def path(self, name: str = "") -> str:
        """The store's path of a relative name (validated); the root for `""`.

        A real file path on this host only where `capabilities.local_paths`.
        """
        if not name:
            return self.root
        return posixpath.join(self.root, validate_relative_name(name))

    def write(
        self,
        name: str,
        data: bytes | bytearray | memoryview,
        *,
        exclusive: bool = False,
        chunk_bytes: int = 64 << 20,
        concurrency: int = 8,
        staged: Iterable[int] | None = None,
    ) -> None:
        """Write one object atomically (whole or absent).

        Args:
            name: relative name; parent folders are created on local disk.
            data: the bytes.
            exclusive: fail with `ObjectExistsError` if the object exists (commit marker).
            chunk_bytes: multipart part size on object stores.
            concurrency: parts uploaded in parallel on object stores.
            staged: `data` is still being filled: increasing counts of its leading bytes
                that are final, ending with `len(data)` (see `backends/direct_write.py`).
                Stores with `capabilities.progressive_write` write each part as it becomes
                final; others wait for the last count.

        Raises:
            ObjectExistsError: `exclusive` and the object exists.
            StorageError: the write failed; nothing was published under `name`.
        """
        path = self.path(name)
        with translated("write", path):
            self.backend.write(
                path,
                data,
                exclusive=exclusive,
                chunk_bytes=chunk_bytes,
                concurrency=concurrency,
                staged=staged,
            )

    def abort_uploads(self, name: str = "", *, older_than_s: float = 0.0) -> int:
        """Abort incomplete multipart uploads under a folder (S3; 0 on other stores).

        See [Note: orphaned multipart uploads] in `_store/backends/multipart.py`: a writer
        killed mid-upload leaves its upload behind. Call this only where no live writer may
        still be uploading there, or with an `older_than_s` no live upload can reach.

        Args:
            name: relative folder (`""`: the whole root).
            older_than_s: only uploads started at least this long ago (by the server's clock
                against ours; an upload of unknown age counts as old).

        Returns:
            How many uploads were aborted.

        Raises:
            StorageError: the listing or an abort failed.
        """
        path = self.path(name)
        with translated("abort uploads under", path):
            return self.backend.abort_uploads(path, older_than_s=older_than_s)

    def put_file(
        self,
        local_path: str,
        name: str,
        *,
        exclusive: bool = False,
        chunk_bytes: int = 64 << 20,
        concurrency: int = 8,
    ) -> None:
        """Publish a finished local file as `name`, atomically (whole or absent).

        Local disk: the file is fsynced and moved into place (`local_path` is consumed; a
        file on another filesystem is copied next to the target first). Object stores: the
        file is streamed from disk, as a parallel multipart upload when it is large, never
        held in memory whole.

        Args:
            local_path: the finished file.
            name: relative destination name; parent folders are created on local disk.
            exclusive: fail with `ObjectExistsError` if `name` exists (on local disk by
                `os.link`; elsewhere a check, then the upload).
            chunk_bytes: multipart part size on object stores.
            concurrency: parts uploaded in parallel on object stores.

        Raises:
            ObjectExistsError: `exclusive` and the destination exists.
            StorageError: the move or upload failed; nothing was published under `name`.
        """
        dest = self.path(name)
        with translated("write", dest):
            self.backend.put_file(
                local_path,
                dest,
                exclusive=exclusive,
                chunk_bytes=chunk_bytes,
                concurrency=concurrency,
            )

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or bytes `[start, end)` of it."""
        path = self.path(name)
        with translated("read", path):
            return self.backend.read(path, start, end)

    def read_into(self, name: str, start: int, out: memoryview) -> int:
        """Read bytes `[start, start + len(out))` of an object into `out`; the count read
        (short only where the object ends)."""
        path = self.path(name)
        with translated("read", path):
            return self.backend.read_into(path, start, out)

    def read_with_version(self, name: str) -> tuple[bytes, str]:
        """Read a whole object and the version token `write_if` compares against.

        Raises:
            ObjectNotFoundError: the object does not exist.
            StorageError: the read failed.
        """
        path = self.path(name)
        with translated("read", path):
            return self.backend.read_with_version(path)

    def write_if(self, name: str, data: bytes, *, expected_version: str | None) -> str:
        """Write a small object only if it is still at `expected_version` (compare-and-swap).

        A version identifies content (an S3 ETag is its MD5; elsewhere its SHA-256): writing
        the very bytes already there keeps the version, so callers that need every write to
        count put a counter or token in the document (the lease does). Race-free against
        other processes only where `capabilities.race_free_conditional_write`.

        Args:
            name: relative name.
            data: the whole new content.
            expected_version: the version `read_with_version` returned, or None to create
                the object only if it does not exist.

        Returns:
            The new version.

        Raises:
            VersionMismatchError: the object is at another version (or exists when None was
                expected, or is gone): another writer got there first; nothing was written.
            StorageError: the write failed.
        """
        path = self.path(name)
        with translated("conditional write", path):
            return self.backend.write_if(path, data, expected_version=expected_version)

    def read_many(self, names: list[str]) -> list[bytes | CheckpointError]:
        """Read whole objects; on async filesystems (S3) as concurrent requests in one batch.

        Returns, in order, each object's bytes or the `StorageError` (`ObjectNotFoundError`
        for a missing object) its read failed with, so one bad name never hides the others.
        """
        paths = [self.path(n) for n in names]
        if not paths:
            return []
        with translated("read", paths[0]):
            results = self.backend.read_many(paths)
        return [
            storage_error("read", path, r) if isinstance(r, Exception) else r
            for path, r in zip(paths, results, strict=True)
        ]

    def size(self, name: str) -> int:
        """Size in bytes of an object."""
        path = self.path(name)
        with translated("stat", path):
            return self.backend.size(path)

    def exists(self, name: str) -> bool:
        """Whether an object or folder exists."""
        path = self.path(name)
        with translated("stat", path):
            return self.backend.exists(path)

    def list_names(self, name: str = "") -> list[str]:
        """Names of the direct children of a folder (empty if it does not exist), sorted."""
        path = self.path(name)
        with translated("list", path):
            return self.backend.list_names(path)

    def modified_unix_s(self, name: str) -> float | None:
        """Last modification time of an object, or of the newest object anywhere in a folder."""
        path = self.path(name)
        with translated("stat", path):
            return self.backend.modified_unix_s(path)

    def remove(self, name: str) -> None:
        """Delete one object; a missing object is fine."""
        path = self.path(name)
        with translated("delete", path):
            self.backend.remove(path)

    def remove_tree(self, name: str) -> None:
        """Delete a folder and everything under it; a missing folder is fine."""
        path = self.path(name)
        with translated("delete", path):
            self.backend.remove_tree(path)

    def move_tree(self, name: str, to: str) -> None:
        """Move a folder and everything under it to `to` (which must not exist).

        One atomic rename on local disk; on object stores each object is copied on the
        server and the source removed once every copy is done (a move cut short leaves a
        complete copy of what it reached and the source, whole or partly removed).

        Raises:
            StorageError: the move failed (`ObjectNotFoundError`: no such folder).
        """
        src, dst = self.path(name), self.path(to)
        with translated("move", src):
            self.backend.move_tree(src, dst)

    def keep_buffer(self, buffer: mmap.mmap) -> bool:
        """Make repeated `write`s from the mapping `buffer` cheaper where the store can (see
        `StorageBackend.keep_buffer`); call `release_buffer` before unmapping it."""
        return self.backend.keep_buffer(buffer)

    def release_buffer(self, buffer: mmap.mmap) -> None:
        """Undo `keep_buffer` (a no-op if the buffer was not kept)."""
        self.backend.release_buffer(buffer)

    def describe_missing_root(self) -> str:
        """Why the root does not exist, for an operator (a missing bucket, an empty prefix,
        no such folder); never raises."""
        return self.backend.describe_missing_root()

    def retrying(
        self,
        action: Callable[[], _T],
        *,
        deadline: float,
        on_retry: Callable[[BaseException, float], None] | None = None,
    ) -> _T:
        """`action()`, retried on this store's transient failures until `deadline`.

        Only remote stores (`capabilities.remote`) retry, and only failures that may go away
        by themselves (`backend_errors.is_transient`: unreachable, timeouts, throttling,
        5xx); anything else, or a retry that would end past the deadline, raises at once.
        Delays start at 1 s and double up to 30 s. See [Note: a store outage is waited out,
        not failed] in `_save/writer.py`.

        Args:
            action: what to do (it must be safe to repeat).
            deadline: `time.monotonic()` after which no retry starts.
            on_retry: called with the error and the delay before each retry (for logging).
        """
        delay = 1.0
        while True:
            try:
                return action()
            except Exception as err:
                if not self.capabilities.remote or not is_transient(err):
                    raise
                if time.monotonic() + delay > deadline:
                    raise
                if on_retry is not None:
                    on_retry(err, delay)
                time.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_DELAY_S)
