"""Backend errors at the storage edge: translation into the `StorageError` tree, and what
the replies of an object store mean (transient, a failed condition, a version conflict).

`storage.py` is the only caller for translation, and reads `is_transient` to wait out
transient failures of remote stores (`Storage.retrying`; [Note: a store outage is waited
out, not failed] in `_save/writer.py`); the S3 backend reads the condition replies.
Nothing here imports botocore: errors are recognised by class name and by the
botocore-style `response` dict, so aiobotocore and other S3 clients work alike.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any

from ckpt_manager.errors import (
    CheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
)

__all__ = [
    "is_conditional_conflict",
    "is_precondition_failed",
    "is_transient",
    "storage_error",
    "translated",
]


def storage_error(op: str, path: str, err: Exception) -> CheckpointError:
    """The `StorageError` subclass for a backend error (a `CheckpointError` is kept)."""
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, FileExistsError):
        return ObjectExistsError(errno.EEXIST, f"{op} {path}: already exists ({err})")
    if isinstance(err, FileNotFoundError):
        return ObjectNotFoundError(errno.ENOENT, f"{op} {path}: not found ({err})")
    if isinstance(err, OSError):
        code = err.errno if err.errno is not None else errno.EIO
        return StorageError(code, f"{op} {path} failed: {err}")
    # botocore/aiohttp errors that s3fs did not translate (connection refused, timeouts).
    return StorageError(errno.EIO, f"{op} {path} failed: {type(err).__name__}: {err}")


@contextlib.contextmanager
def translated(op: str, path: str) -> Iterator[None]:
    """Re-raise any backend error inside the block as `storage_error(op, path, err)`."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        raise storage_error(op, path, err) from err


_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientPayloadError",
    }
)
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling"}
)


def _s3_replies(err: BaseException, *, follow_context: bool) -> Iterator[tuple[Any, Any]]:
    """`(error code, HTTP status)` of each botocore-style reply in `err`'s cause chain."""
    seen: BaseException | None = err
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            yield (
                response.get("Error", {}).get("Code"),
                response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            )
        seen = seen.__cause__ or (seen.__context__ if follow_context else None)


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = err
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def is_transient(err: BaseException) -> bool:
    """Whether a storage failure may go away by itself: the store is unreachable, timed
    out, throttles or answers 5xx (an outage, a restart, a network blip). Refusals (4xx:
    credentials, a missing bucket, a failed condition) and local-disk errors are not: retrying
    them would only delay the error an operator has to fix.
    """
    if any(
        isinstance(e, ConnectionError | TimeoutError) or type(e).__name__ in _TRANSIENT_NAMES
        for e in _chain(err)
    ):
        return True
    return any(
        code in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500)
        for code, status in _s3_replies(err, follow_context=True)
    )


def is_precondition_failed(err: BaseException) -> bool:
    """Whether an S3 error (or its cause) is HTTP 412 PreconditionFailed."""
    if any(
        code == "PreconditionFailed" or status == 412
        for code, status in _s3_replies(err, follow_context=False)
    ):
        return True
    text = str(err).lower()
    return "precondition" in text or "pre-condition" in text


def is_conditional_conflict(err: BaseException) -> bool:
    """Whether an S3 error means "not at the expected version": 412, or 409 (a concurrent
    conditional write), or 404 (`If-Match` on an object that is gone)."""
    if is_precondition_failed(err) or isinstance(err, FileNotFoundError):
        return True
    return any(
        code in ("ConditionalRequestConflict", "NoSuchKey") or status in (404, 409)
        for code, status in _s3_replies(err, follow_context=False)
    )
