"""Counting the requests and bytes a piece of code makes through one `Storage`.

Two counts, both measured (never estimated):

* `calls`: every `Storage` operation on the instance, by name (`read_many` counts one per
  object). On local disk and `memory://` each is one filesystem request.
* `http`: on S3 roots, every HTTP request the s3fs client sends (botocore's `before-send`
  event, so each page of a paginated LIST and each retry counts), by operation.

`requests` is the HTTP count on S3 and the call count elsewhere; `read_bytes` is what the
reads returned. Tests and `bench/ckpt_scale.py` use it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ckpt_manager._store.backends.s3 import S3Backend
from ckpt_manager._store.storage import Storage

__all__ = ["RequestCounter", "count_requests"]

_COUNTED = (
    "write",
    "write_if",
    "read",
    "read_into",
    "read_with_version",
    "read_many",
    "size",
    "exists",
    "list_names",
    "modified_unix_s",
    "remove",
    "remove_tree",
    "put_file",
    "abort_uploads",
)


class RequestCounter:
    """What `count_requests` saw."""

    def __init__(self, *, is_s3: bool) -> None:
        self.is_s3 = is_s3
        """Whether `http` counts (S3 root)."""
        self.calls: collections.Counter[str] = collections.Counter()
        """Storage operations by method name."""
        self.http: collections.Counter[str] = collections.Counter()
        """HTTP requests by S3 operation (S3 only)."""
        self.read_bytes = 0
        """Bytes returned by reads."""

    @property
    def requests(self) -> int:
        """HTTP requests on S3, Storage operations elsewhere."""
        return sum(self.http.values()) if self.is_s3 else sum(self.calls.values())

    def reset(self) -> None:
        """Start counting from zero."""
        self.calls.clear()
        self.http.clear()
        self.read_bytes = 0


def _counted(counter: RequestCounter, name: str, method: Callable[..., Any]) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = method(*args, **kwargs)
        except BaseException:
            counter.calls[name] += 1  # a failed request (a missing object) is a request too
            raise
        if name == "read_many":
            counter.calls[name] += len(result)
            counter.read_bytes += sum(len(r) for r in result if isinstance(r, bytes))
            return result
        counter.calls[name] += 1
        if name == "read":
            counter.read_bytes += len(result)
        elif name == "read_into":
            counter.read_bytes += result  # the count read into the caller's buffer
        elif name == "read_with_version":
            counter.read_bytes += len(result[0])
        return result

    return wrapper


@contextlib.contextmanager
def count_requests(storage: Storage) -> Iterator[RequestCounter]:
    """Count what `storage` (this instance) does inside the block."""
    is_s3 = isinstance(storage.backend, S3Backend)
    counter = RequestCounter(is_s3=is_s3)
    for name in _COUNTED:
        setattr(storage, name, _counted(counter, name, getattr(storage, name)))
    events = None

    def on_send(event_name: str = "", **_: Any) -> None:
        counter.http[event_name.rsplit(".", 1)[-1]] += 1

    if is_s3:
        storage.backend.fs.connect()  # the client exists only after the first request otherwise
        events = storage.backend.fs.s3.meta.events
        events.register("before-send.s3", on_send)
    try:
        yield counter
    finally:
        for name in _COUNTED:
            vars(storage).pop(name, None)
        if events is not None:
            events.unregister("before-send.s3", on_send)
