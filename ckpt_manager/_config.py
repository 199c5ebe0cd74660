"""Configuration of the checkpoint manager: `AsyncMode`, `MemoryTierConfig`, `CheckpointConfig`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from ckpt_manager._format.layout import MAX_SPREAD_PREFIXES
from ckpt_manager._retention.base import RetentionPolicy
from ckpt_manager._store.options import S3Options

__all__ = ["DEFAULT_S3_SPREAD_PREFIXES", "AsyncMode", "CheckpointConfig", "MemoryTierConfig"]

_MIB = 1 << 20
DEFAULT_S3_SPREAD_PREFIXES = 16
"""Sub-prefixes per step on `s3://` roots unless configured ([Note: request spreading]):
16 x 3,500 PUT/s per prefix is 56,000 PUT/s, room for the ~20,000 PUT-class requests of a
1024-rank save arriving within a second, and only 16 folder levels for tools to show."""


class AsyncMode(enum.StrEnum):
    """Where shard files are written."""

    PERSISTENT = "persistent"
    """One long-lived writer process per rank, reused across saves (default)."""
    TEMPORAL = "temporal"
    """A fresh writer process per save, gone when the save is written."""
    SYNC = "sync"
    """Inline in `save()`: blocks until the step is committed."""


MIN_MEMORY_SLOTS = 2
"""A memory tier needs two slots per rank: the newest complete one is never overwritten."""


# Not kw_only, unlike the other configs: `MemoryTierConfig("/dev/shm/run")` reads well and the
# daemon builds it from one path.
@dataclasses.dataclass(frozen=True)
class MemoryTierConfig:
    """Where a rank keeps its memory snapshots ([Note: the memory tier] in `_memory/`)."""

    directory: str
    """An existing directory, on a tmpfs (`/dev/shm`, a Kubernetes in-memory `emptyDir`),
    owned by the caller: it creates it before the manager starts and removes it when the run
    ends; the manager creates and reuses its slot files inside (`rank-<r>.slot-<k>`)."""
    slots: int = MIN_MEMORY_SLOTS
    """Snapshot slots per rank (at least 2); one more is taken while a durable write still
    reads a slot the next snapshot would need."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ValueError(
                f"memory tier directory={self.directory!r}: give the path of an existing "
                "directory on a tmpfs (e.g. /dev/shm/<run>)"
            )
        if isinstance(self.slots, bool) or not isinstance(self.slots, int):
            raise ValueError(f"memory tier slots={self.slots!r}: use an int of 2 or more")
        if self.slots < MIN_MEMORY_SLOTS:
            raise ValueError(
                f"memory tier slots={self.slots}: use {MIN_MEMORY_SLOTS} or more (the newest "
                "complete snapshot is never overwritten, so one slot cannot take the next)"
            )


@dataclasses.dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """How a `CheckpointManager` saves, commits, retains and restores."""

    async_mode: AsyncMode = AsyncMode.PERSISTENT
    """Writer model; `memory://` roots need `SYNC` (the filesystem lives in this process)."""
    max_inflight: int = 1
    """Saves in flight at once; a further `save()` waits for the oldest (reported as stall)."""
    retention: RetentionPolicy | None = None
    """Which committed steps to keep (`None` keeps all); pinned steps are always kept."""
    finalize_timeout_s: float = 300.0
    """Limit of each checkpoint collective on the manager's gloo group."""
    write_timeout_s: float = 1800.0
    """Limit for one rank's writer to make its files durable."""
    writer_start_timeout_s: float = 120.0
    """Limit for a writer process to start and answer."""
    staging_timeout_s: float = 600.0
    """Limit for the snapshot copy into staging memory (`before_optimizer_step()` fence)."""
    staging_nice: int = 0
    """How many nice steps below the thread that made the manager the staging thread copies
    snapshots (0 to 19; 0: the same priority): where training has no spare core, a lower
    priority lets the copy take the core's idle gaps before the training's time ([Note: the
    staging thread yields to training] in `_save/staging.py`). Linux only; elsewhere the
    thread runs as it is."""
    lease_ttl_s: float = 120.0
    """A lease not refreshed for this long is expired and may be taken over."""
    uncommitted_grace_s: float = 3600.0
    """Uncommitted step folders that appear above the newest step this run has saved (another
    rank may be writing them ahead of the coordinator) are garbage-collected once older than
    this; every other one goes at once (at the root's start-up, or once this run has saved a
    later step)."""
    deletion_retry_s: float = 30.0
    """Delay before a failed retention deletion is retried."""
    verify_checksums: bool = True
    """Restore checks every file's crc32, not only its size."""
    upload_chunk_bytes: int = 64 * _MIB
    """Part size of multipart uploads to object stores (at least 5 MiB)."""
    upload_concurrency: int = 8
    """Parts uploaded in parallel per file on object stores."""
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Extra fsspec options for the root (S3 endpoint, credentials, region ...)."""
    spread_prefixes: int | None = None
    """Sub-prefixes each step's rank objects are spread over (0: plain names; at most 256);
    None: `DEFAULT_S3_SPREAD_PREFIXES` on `s3://` roots, 0 elsewhere ([Note: request
    spreading] in `_format/layout.py`)."""
    memory: MemoryTierConfig | None = None
    """The memory tier: every `save()` snapshots the rank's state into a slot file there and
    `restore()` tries the newest step every rank holds in memory first (None: off)."""

    def __post_init__(self) -> None:
        mode: object = self.async_mode
        if not isinstance(mode, AsyncMode):
            try:
                object.__setattr__(self, "async_mode", AsyncMode(str(mode)))
            except ValueError:
                allowed = ", ".join(m.value for m in AsyncMode)
                raise ValueError(
                    f"async_mode={self.async_mode!r} is unknown; use one of: {allowed}"
                ) from None
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight={self.max_inflight}: use 1 or more")
        if not 0 <= self.staging_nice <= 19:
            raise ValueError(
                f"staging_nice={self.staging_nice}: use 0 (the training thread's priority) to 19"
            )
        for name in (
            "finalize_timeout_s",
            "write_timeout_s",
            "writer_start_timeout_s",
            "staging_timeout_s",
            "lease_ttl_s",
            "deletion_retry_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: use a positive number of seconds")
        if self.uncommitted_grace_s < 0:
            raise ValueError(f"uncommitted_grace_s={self.uncommitted_grace_s}: use 0 or more")
        if self.upload_chunk_bytes < 5 * _MIB:
            raise ValueError(
                f"upload_chunk_bytes={self.upload_chunk_bytes}: S3 parts must be at least 5 MiB"
            )
        if self.upload_concurrency < 1:
            raise ValueError(f"upload_concurrency={self.upload_concurrency}: use 1 or more")
        if self.spread_prefixes is not None and not (
            0 <= self.spread_prefixes <= MAX_SPREAD_PREFIXES
        ):
            raise ValueError(
                f"spread_prefixes={self.spread_prefixes}: use 0 (plain names) to "
                f"{MAX_SPREAD_PREFIXES}, or None for the default of the root's store"
            )
        if self.memory is not None and not isinstance(self.memory, MemoryTierConfig):
            raise ValueError(
                f"memory={self.memory!r}: use a MemoryTierConfig(directory=...) or None"
            )
        if self.retention is not None and not callable(getattr(self.retention, "keep", None)):
            raise ValueError("retention must be a RetentionPolicy (an object with keep(steps))")

    def spread_for(self, root_uri: str) -> int:
        """The sub-prefixes a save under `root_uri` spreads its rank objects over."""
        if self.spread_prefixes is not None:
            return self.spread_prefixes
        return DEFAULT_S3_SPREAD_PREFIXES if S3Options.serves(root_uri) else 0
