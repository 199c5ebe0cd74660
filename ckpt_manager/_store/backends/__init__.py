"""Storage backends: one module per store, and the registry that picks one for a URI.

The only place that knows which store a root is on (an ast test,
`tests/ckpt_manager/store/test_backend_seam.py`, keeps protocol names, `s3fs` and fsspec's
`LocalFileSystem` in here). `Storage` (`_store/storage.py`) is the front every caller uses;
callers ask its `capabilities`, never the protocol.

    base.py         the seam: the StorageBackend Protocol (atomic publish, exclusive
                    create, conditional replace, ranged and batch reads, streamed publish
                    of a local file, listing, deletion, aborting uploads),
                    [Note: the backend contract], Capabilities, BackendFactory.
    fsspec.py       FsspecBackend: any fsspec filesystem (`memory://`, `gs://`, ...), the
                    fallback for every scheme not registered below (unless the filesystem
                    it opens is one a registered backend serves: `open_backend`), and the
                    base of the two backends that follow; check-then-write under a
                    process mutex.
    local.py        LocalBackend: temp file + fsync + rename/link, O_DIRECT, flock.
    s3.py           S3Backend: uploads from the buffer, If-None-Match / If-Match, aborting
                    incomplete uploads, SeaweedFS's folder keys.
    multipart.py    S3 uploads straight from a buffer (no copy), aborted on failure;
                    listing and aborting incomplete uploads left by killed writers.
    direct_write.py large local writes with O_DIRECT from page-aligned slabs, buffered tail
                    and fallback; from registered mappings (`keep_buffer`) through uring.py.
    uring.py        DirectRing: io_uring through ctypes, buffers registered (pinned) once,
                    O_DIRECT writes from them without pinning (x86-64; off where refused).
    lazy_log.py     LazyLogger: structlog imported at the first message (the writer
                    process imports these modules and starts without structlog).

Adding a backend: a module here with a class that satisfies `StorageBackend` and
`BackendFactory` (its `name`, its URI `schemes`, `open(root_uri, storage_options)`), one line
in `_REGISTERED` below, and a fixture of the storage contract suite
(`tests/ckpt_manager/conftest.py::backend_root`; a test fails for a registered backend
without one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ckpt_manager._store.backends.base import BackendFactory, Capabilities, StorageBackend
from ckpt_manager._store.backends.fsspec import FsspecBackend, open_filesystem
from ckpt_manager._store.backends.local import LocalBackend
from ckpt_manager._store.backends.s3 import S3Backend

__all__ = [
    "BackendFactory",
    "Capabilities",
    "StorageBackend",
    "backend_for",
    "local_path",
    "open_backend",
    "registered_backends",
    "serves_s3",
    "uri_scheme",
]

# The registration lines: each backend serves the URI schemes it names.
_REGISTERED: tuple[BackendFactory, ...] = (
    LocalBackend,
    S3Backend,
)
_FALLBACK: BackendFactory = FsspecBackend  # any other fsspec filesystem
_BY_SCHEME: dict[str, BackendFactory] = {s: b for b in _REGISTERED for s in b.schemes}


def registered_backends() -> tuple[BackendFactory, ...]:
    """Every backend a URI can be served by: the registered ones, then the fallback."""
    return (*_REGISTERED, _FALLBACK)


def uri_scheme(uri: str) -> str:
    """The scheme of `uri` (`file` for a plain path)."""
    return uri.split("://", 1)[0] if "://" in uri else "file"


def backend_for(uri: str) -> BackendFactory:
    """The backend that serves `uri`'s scheme (the generic fsspec one for unregistered)."""
    return _BY_SCHEME.get(uri_scheme(uri), _FALLBACK)


def open_backend(root_uri: str, storage_options: Mapping[str, Any]) -> StorageBackend:
    """Open `root_uri` with the backend that serves its scheme.

    A scheme no backend registers is opened with fsspec; if the filesystem it names is one
    a registered backend serves (a `LocalFileSystem` subclass under a protocol of its own),
    that backend gets it, else the generic one.

    Raises:
        ValueError: the URI cannot be opened (unknown protocol, missing driver, bad options).
    """
    backend = backend_for(root_uri)
    if backend is not _FALLBACK:
        return backend.open(root_uri, storage_options)
    fs, root = open_filesystem(root_uri, storage_options)
    for candidate in _fsspec_based():
        if candidate.serves_filesystem(fs):
            return candidate(fs, root)
    return FsspecBackend(fs, root)


def _fsspec_based() -> Iterator[type[FsspecBackend]]:
    """The registered backends built on an fsspec filesystem."""
    for backend in _REGISTERED:
        if isinstance(backend, type) and issubclass(backend, FsspecBackend):
            yield backend


def serves_s3(uri: str) -> bool:
    """Whether `uri` is an S3 root (`s3://`, `s3a://`), which `S3Options` describe."""
    return backend_for(uri) is S3Backend


def local_path(uri: str) -> str | None:
    """The path on this host that `uri` names (a plain path, `file://...`), else None."""
    if backend_for(uri) is not LocalBackend:
        return None
    return LocalBackend.path_of(uri)
