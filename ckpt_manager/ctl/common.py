"""What every `ckptctl` command shares: storage options, opening a root, resolving steps.

Storage itself (paths, backends, error translation) lives in `_store/storage.py` and S3 options
in `_store/options.py`; this module only maps command-line flags onto those and turns the few
failures an operator can fix (unknown scheme, missing bucket, missing path, no credentials)
into one-line messages.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.indexes import complete_manifest
from ckpt_manager._store.options import S3Options
from ckpt_manager._store.steps import list_step_dirs, read_manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.errors import CheckpointError, StepNotFoundError, StorageError

__all__ = [
    "LATEST",
    "StorageFlags",
    "describe_error",
    "nearest_steps",
    "open_root",
    "resolve_step",
]

LATEST = "latest"
_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "ProfileNotFound")


@dataclasses.dataclass(kw_only=True, frozen=True)
class StorageFlags(S3Options):
    """Global storage options of `ckptctl` (they apply to every S3 URI of a command): the
    engine's `S3Options`, with a bad combination reported as a usage error (exit 2)."""

    def __post_init__(self) -> None:
        # The same rules as S3Options, worded with the flags an operator typed.
        if self.anon and self.profile:
            raise UsageError("--anon and --profile exclude each other: drop one")
        try:
            super().__post_init__()
        except ValueError:
            raise UsageError(
                f"--endpoint-url {self.endpoint_url!r} needs a scheme, e.g. http://127.0.0.1:9000"
            ) from None

    def options_for(self, uri: str) -> dict[str, Any]:
        """fsspec options for `uri`: the S3 flags for `s3://` URIs, nothing for others."""
        return self.fsspec_options(uri)


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def describe_error(err: BaseException) -> str:
    """One line an operator can act on, for any error a command lets escape."""
    for e in _chain(err):
        name = type(e).__name__
        if name in _CREDENTIAL_ERRORS:
            return (
                f"no usable AWS credentials ({name}: {e}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, pass --profile NAME, or --anon for a public bucket"
            )
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        text = err.strerror.strip().splitlines()[0]  # without the "[Errno N]" prefix
    if isinstance(err, CheckpointError | UsageError):
        return text
    return f"{type(err).__name__}: {text}"


def open_root(uri: str, flags: StorageFlags, *, must_exist: bool = True) -> Storage:
    """Open a checkpoint root (or a destination) for a command.

    Args:
        uri: local path, `file://`, `s3://bucket/prefix` or another fsspec URL.
        flags: global storage options.
        must_exist: fail when the root does not exist (every command but restore targets).

    Raises:
        UsageError: unknown URI scheme.
        StorageError: the bucket or the path does not exist, or storage failed.
    """
    if not uri:
        raise UsageError("empty checkpoint URI: pass a path or s3://bucket/prefix")
    try:
        storage = Storage(uri, flags.options_for(uri))
    except ValueError as err:
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        hint = f"unknown URI scheme {scheme + '://'!r}" if scheme else "cannot open it"
        raise UsageError(
            f"{uri}: {hint} (use a local path or s3://bucket/prefix): {err.__cause__ or err}"
        ) from err
    if must_exist and not storage.exists(""):
        raise StorageError(2, f"{uri}: {storage.describe_missing_root()}")
    return storage


def nearest_steps(steps: Sequence[int], step: int, count: int = 3) -> list[int]:
    """Up to `count` steps of `steps` (sorted) closest to `step`, ascending."""
    i = bisect.bisect_left(steps, step)
    window = list(steps[max(0, i - count) : i + count])
    window.sort(key=lambda s: (abs(s - step), s))
    return sorted(window[:count])


def resolve_step(storage: Storage, spec: str | int | None) -> tuple[int, Manifest]:
    """Resolve `latest` (or None) / a step number to a committed step and its manifest.

    The manifest is complete: a format-2 step's rank indexes are read and merged in.

    Raises:
        UsageError: `spec` is neither `latest` nor a non-negative integer.
        StepNotFoundError: no committed step there; the message lists the nearest ones.
        CorruptCheckpointError: the manifest exists but is invalid.
    """
    if spec is None or spec == LATEST:
        committed = committed_of(storage, list_step_dirs(storage))
        if not committed:
            raise StepNotFoundError(f"{storage.root_uri}: no committed step")
        return committed[-1], complete_manifest(storage, read_manifest(storage, committed[-1]))
    try:
        step = int(spec)
    except ValueError:
        raise UsageError(f"step {spec!r}: use a step number or 'latest'") from None
    if step < 0:
        raise UsageError(f"step {step}: steps are >= 0")
    try:
        return step, complete_manifest(storage, read_manifest(storage, step))
    except StepNotFoundError as err:
        steps = list_step_dirs(storage)
        state = " (its folder exists but it is not committed)" if step in steps else ""
        near = nearest_steps(committed_of(storage, steps), step)
        hint = f"; nearest committed: {', '.join(map(str, near))}" if near else "; none committed"
        raise StepNotFoundError(
            f"{storage.root_uri}: no committed step {step}{state}{hint}"
        ) from err


def committed_of(storage: Storage, steps: Sequence[int]) -> list[int]:
    """The steps (ascending) whose manifest exists, probed in parallel on remote stores."""
    names = [f"{step_dir(s)}/{MANIFEST_NAME}" for s in steps]
    found = parallel_map(storage.exists, names, storage)
    return [s for s, ok in zip(steps, found, strict=True) if ok]


def parallel_map(fn: Any, items: Sequence[Any], storage: Storage) -> list[Any]:
    """`[fn(x) for x in items]`, on a thread pool where the store's reads are latency-bound
    (`capabilities.read_concurrency` threads at most).

    Exceptions are returned in place of results, so one bad item never hides the others.
    """
    workers = min(storage.capabilities.read_concurrency, len(items))
    if workers < 2:
        return [_call(fn, x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptctl") as pool:
        return list(pool.map(lambda x: _call(fn, x), items))


def _call(fn: Any, x: Any) -> Any:
    try:
        return fn(x)
    except Exception as err:  # reported per item by the caller
        return err


def metrics_text(metrics: Mapping[str, Any], limit: int = 3) -> str:
    """`loss=2.31 acc=0.5` for a table cell (first `limit` numeric or short metrics)."""
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, int | str | bool):
            parts.append(f"{key}={value}")
        if len(parts) == limit:
            break
    return " ".join(parts)
