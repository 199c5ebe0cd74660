"""Any fsspec filesystem (`memory://`, `gs://`, ...): the generic backend and the fallback.

Also the base of the local and S3 backends, which override what their store does better
(atomic rename, server-side conditions). Here:

* Atomic writes: one `pipe_file` / `put_file` of the whole object, as atomic as the
  filesystem's own write (an object store's PUT is; `memory://` sets the bytes at once).
* Exclusive create and conditional writes (`write_if`): check-then-write under a mutex of
  this process (exclusive create through the filesystem's own `mode="create"`). Not
  race-free against another process (documented in CONTRACTS.md; the lease keeps two runs
  from committing to one root); `memory://` lives in this process only, so for it the mutex
  covers every writer. The version is the content's SHA-256.
* Listings and stats are never served from fsspec's cache (another process wrote the
  objects).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import mmap
import posixpath
import threading
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Self

import fsspec.core

from ckpt_manager._store.backends.base import Capabilities
from ckpt_manager.errors import ObjectExistsError, VersionMismatchError

__all__ = [
    "REMOTE_READ_CONCURRENCY",
    "REMOTE_READ_PREFETCH",
    "FsspecBackend",
    "content_version",
    "drain",
    "open_filesystem",
    "protocols_of",
]

# Object stores served by this generic backend (S3 has its own): remote, so transient
# errors are waited out and reads prefetched, as on S3.
_OBJECT_STORE_PROTOCOLS = frozenset({"gs", "gcs", "az", "abfs", "abfss"})
_PROCESS_LOCAL_PROTOCOLS = frozenset({"memory"})
_CONDITIONAL_LOCK = threading.Lock()  # conditional writes on stores without a server check
REMOTE_READ_PREFETCH = 3
"""Ranged reads kept in flight ahead of a streaming reader on a remote store."""
REMOTE_READ_CONCURRENCY = 32
"""Small independent reads (existence probes, manifests) run at once on a remote store."""


def content_version(data: bytes) -> str:
    """The version token of content on stores without their own (its SHA-256)."""
    return hashlib.sha256(data).hexdigest()


def drain(staged: Iterable[int] | None) -> None:
    """Wait for a staged buffer's last count (stores that upload finished bytes only)."""
    for _ in staged or ():
        pass


def open_filesystem(root_uri: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    """`fsspec.core.url_to_fs(root_uri)`: the filesystem and the root as its own path.

    Raises:
        ValueError: the URI cannot be resolved to a filesystem.
    """
    try:
        fs, root = fsspec.core.url_to_fs(root_uri, **storage_options)
    except (ValueError, ImportError) as err:
        raise ValueError(f"cannot open checkpoint root {root_uri!r}: {err}") from err
    return fs, root.rstrip("/") or "/"


def protocols_of(fs: Any) -> frozenset[str]:
    """Every protocol name an fsspec filesystem answers to."""
    found = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    return frozenset(map(str, found))


def _as_unix_s(value: Any) -> float | None:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    if isinstance(value, int | float):
        return float(value)
    return None


class FsspecBackend:
    """A root on any fsspec filesystem; see the module docstring for its guarantees."""

    name: ClassVar[str] = "fsspec"
    """Registry name."""
    schemes: ClassVar[tuple[str, ...]] = ()
    """None of its own: the registry's fallback for every scheme no other backend serves."""
    fixed_capabilities: ClassVar[Capabilities | None] = None
    """A subclass's capabilities; None: derived from the filesystem's protocol."""

    def __init__(self, fs: Any, root: str) -> None:
        """Wrap an opened filesystem.

        Args:
            fs: the fsspec filesystem.
            root: the root as its own path.
        """
        self.fs: Any = fs
        """The fsspec filesystem."""
        self._root = root
        self._capabilities = self.fixed_capabilities or self._capabilities_of(protocols_of(fs))

    @classmethod
    def open(cls, root_uri: str, storage_options: Mapping[str, Any]) -> Self:
        """The backend for `root_uri`, opened with fsspec.

        Raises:
            ValueError: the URI cannot be resolved to a filesystem.
        """
        return cls(*open_filesystem(root_uri, storage_options))

    @classmethod
    def probe(cls, root_uri: str, storage_options: Mapping[str, Any], *, timeout_s: float) -> None:
        """The root opens. A generic filesystem has no probe that is both quick and writes
        nothing; its first real write reports what is wrong, as a `StorageError`."""
        cls.open(root_uri, storage_options)

    @classmethod
    def serves_filesystem(cls, fs: Any) -> bool:
        """Whether this backend is the one for an opened filesystem reached through an
        unregistered scheme (see `backends.open_backend`); the generic one serves any."""
        return True

    @staticmethod
    def _capabilities_of(protocols: frozenset[str]) -> Capabilities:
        remote = bool(protocols & _OBJECT_STORE_PROTOCOLS)
        shared = not (protocols & _PROCESS_LOCAL_PROTOCOLS)
        return Capabilities(
            local_paths=False,
            remote=remote,
            progressive_write=False,
            read_prefetch=REMOTE_READ_PREFETCH if remote else 0,
            read_concurrency=REMOTE_READ_CONCURRENCY if remote else 1,
            # The process mutex covers every writer only where no other process can write.
            race_free_exclusive_create=not shared,
            race_free_conditional_write=not shared,
            shared_across_processes=shared,
        )

    @property
    def root(self) -> str:
        """The root as the filesystem's own path."""
        return self._root

    @property
    def location(self) -> str:
        """The root as a URL with the filesystem's primary protocol."""
        return str(self.fs.unstrip_protocol(self._root))

    @property
    def capabilities(self) -> Capabilities:
        """See `Capabilities`."""
        return self._capabilities

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
        """One `pipe_file` of the whole object, once the last staged count arrived."""
        drain(staged)
        if not exclusive:
            self.fs.pipe_file(path, bytes(data), mode="overwrite")
            return
        with _CONDITIONAL_LOCK:
            self.fs.pipe_file(path, bytes(data), mode="create")

    def put_file(
        self, local_path: str, path: str, *, exclusive: bool, chunk_bytes: int, concurrency: int
    ) -> None:
        """The filesystem's own `put_file` (an exclusive one checks first)."""
        if not exclusive:
            self._upload_file(local_path, path, chunk_bytes, concurrency)
            return
        with _CONDITIONAL_LOCK:
            if self.exists(path):
                raise ObjectExistsError(errno.EEXIST, f"write {path}: already exists")
            self._upload_file(local_path, path, chunk_bytes, concurrency)

    def _upload_file(self, local_path: str, path: str, chunk_bytes: int, concurrency: int) -> None:
        self.fs.put_file(local_path, path)

    def read(self, path: str, start: int | None, end: int | None) -> bytes:
        """`cat_file`, whole or ranged."""
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """A ranged `cat_file`, copied into `out` (fsspec has no read into a buffer)."""
        if not len(out):
            return 0
        data = self.fs.cat_file(path, start=start, end=start + len(out))
        out[: len(data)] = data
        return len(data)

    def read_many(self, paths: list[str]) -> list[bytes | Exception]:
        """`cat_ranges` (one concurrent batch on async filesystems)."""
        results = self.fs.cat_ranges(paths, None, None, on_error="return")
        return [r if isinstance(r, Exception) else bytes(r) for r in results]

    def read_with_version(self, path: str) -> tuple[bytes, str]:
        """The content and its SHA-256."""
        data = bytes(self.fs.cat_file(path))
        return data, content_version(data)

    def write_if(self, path: str, data: bytes, *, expected_version: str | None) -> str:
        """Check-then-write under a process mutex (not race-free across processes)."""
        with _CONDITIONAL_LOCK:
            self.check_version(path, expected_version)
            self.fs.pipe_file(path, bytes(data))
        return content_version(data)

    def check_version(self, path: str, expected_version: str | None) -> None:
        """Raise `VersionMismatchError` unless the object's content version (None: absent)
        is `expected_version`."""
        try:
            current: str | None = content_version(bytes(self.fs.cat_file(path)))
        except FileNotFoundError:
            current = None
        if current != expected_version:
            raise VersionMismatchError(
                errno.EAGAIN,
                f"conditional write {path}: expected "
                f"{'no object' if expected_version is None else 'version ' + expected_version}, "
                f"found {'no object' if current is None else 'version ' + current}",
            )

    def size(self, path: str) -> int:
        """`fs.size`, uncached."""
        self.invalidate(path)
        return int(self.fs.size(path))

    def exists(self, path: str) -> bool:
        """`fs.exists`, uncached."""
        self.invalidate(path)
        return bool(self.fs.exists(path))

    def list_names(self, path: str) -> list[str]:
        """The basenames of the folder's listing, uncached, without the folder itself."""
        self.invalidate(path)
        try:
            entries = self._child_paths(path)
        except FileNotFoundError:
            return []
        base = path.rstrip("/")
        out = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        out.discard(posixpath.basename(base))
        return sorted(n for n in out if n)

    def _child_paths(self, path: str) -> list[str]:
        """Paths of the folder's direct children (may include the folder itself)."""
        return [str(e) for e in self.fs.ls(path, detail=False)]

    def modified_unix_s(self, path: str) -> float | None:
        """The object's time, or the newest time anywhere under a folder."""
        self.invalidate(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        found = self._time_of(info)
        if info.get("type") != "directory":
            return found
        # Recursive: a spread step keeps its files one level down, where neither an
        # object store's folder (no time of its own) nor a local folder's mtime (set when
        # a sub-folder is made, not when a file in it is written) sees them.
        times = [self._time_of(e) for e in self.fs.find(path, detail=True).values()]
        known = [t for t in times if t is not None]
        if found is not None:
            known.append(found)
        return max(known) if known else None

    @staticmethod
    def _time_of(info: Mapping[str, Any]) -> float | None:
        for key in ("mtime", "LastModified", "last_modified", "created"):
            value = _as_unix_s(info.get(key))
            if value is not None:
                return value
        return None

    def remove(self, path: str) -> None:
        """`rm_file`; a missing object is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        """`rm(recursive=True)`; a missing folder is fine."""
        self.invalidate(path)
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        self.invalidate(path)

    def move_tree(self, src: str, dst: str) -> None:
        """Copy every object under `src` to the same name under `dst` (server-side where
        the filesystem copies so: S3 `CopyObject`), then remove `src`.

        Not atomic: the source is removed only once every copy is done, so a move cut short
        leaves the source whole or partly removed, and its copied objects complete at `dst`.
        """
        self.invalidate(src)
        self.invalidate(dst)
        base = src.rstrip("/")
        for path in sorted(str(p) for p in self.fs.find(base)):
            rel = path[len(base) :].lstrip("/")
            if rel:
                self.fs.copy(path, f"{dst.rstrip('/')}/{rel}")
        self.invalidate(dst)
        self.remove_tree(src)

    def abort_uploads(self, path: str, *, older_than_s: float) -> int:
        """No resumable uploads here: 0."""
        return 0

    def keep_buffer(self, buffer: mmap.mmap) -> bool:
        """Nothing to keep on a generic filesystem."""
        return False

    def release_buffer(self, buffer: mmap.mmap) -> None:
        """Nothing was kept."""

    def describe_missing_root(self) -> str:
        """A missing bucket or an empty prefix on object stores; else no such folder."""
        if not self._capabilities.remote:
            return "no such file or directory"
        bucket = self._root.split("/", 1)[0]
        try:
            bucket_exists = bool(self.fs.exists(bucket))
        except Exception:  # a bucket we may not list reads as missing here, same advice
            bucket_exists = False
        if not bucket_exists:
            return f"bucket {bucket!r} does not exist (or these credentials cannot see it)"
        return "no such prefix in the bucket (no checkpoint was written there)"

    def invalidate(self, path: str) -> None:
        """Drop fsspec's cached listing of `path` (another process may have written there)."""
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(path)
