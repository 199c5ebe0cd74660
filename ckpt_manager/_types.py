"""Public records and seams: leaves of a state, save reports, stats, restore results."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

__all__ = [
    "ALIASES_KEY",
    "FINALIZE_CALLS_KEPT",
    "MEMORY_SNAPSHOT_HOOK",
    "ManagerStats",
    "RankLocal",
    "RestoreProgress",
    "RestoreResult",
    "SaveObserver",
    "SaveReport",
    "SaveResult",
    "ShardedTensorLike",
]


ALIASES_KEY = "__aliases__"
"""Contract key (CONTRACTS.md): `{tied name: saved name}` inside a model's state dict. Exports
turn it into shared keys; restoring into a template whose checkpoint lacks it keeps the
template's (ties come from the module)."""

MODEL_FILES_KEY = "__model_files__"
"""Contract key (CONTRACTS.md): `{file name: text}` at the top level of a saved state, the files
that describe the model (a Hugging Face `config.json`, `generation_config.json`); `ckptctl
restore --format safetensors` writes them beside the exported weights."""

GROUP_NAMES_KEY = "param_names"
"""Contract key (CONTRACTS.md): the parameter names of one group in an optimizer's
`param_groups`. The DCP export renames it to torch's `"params"` (`get_optimizer_state_dict`
layout)."""


@runtime_checkable
class ShardedTensorLike(Protocol):
    """A shard of a larger tensor (the neutral form `sharding.ShardedTensor` satisfies).

    Box form: `local` sits at `global_offset` inside `global_shape`. Flat form (`flat_range`
    set): `local` is 1-D and holds elements `[start, end)` of the row-major flattened whole.
    """

    @property
    def local(self) -> torch.Tensor:
        """This rank's piece (may have 0 elements)."""

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the whole tensor."""

    @property
    def global_offset(self) -> tuple[int, ...]:
        """N-D offset of `local` in the whole (box form)."""

    @property
    def flat_range(self) -> tuple[int, int] | None:
        """`(start, end)` of `local` in the flattened whole, or None for the box form."""


@dataclasses.dataclass(frozen=True)
class RankLocal:
    """A subtree written by every rank and restored to the same rank index.

    Use it for RNG states and data-loader positions. On restore the subtree saved by this
    rank replaces the wrapper; a rank that did not exist in the saved world keeps the
    template's subtree (or gets `None` without a template).
    """

    value: Any
    """The subtree: tensors and plain JSON values."""


class SaveResult(enum.StrEnum):
    """Outcome of one save."""

    COMMITTED = "committed"
    """Every rank's files are durable and the manifest is written."""
    FAILED = "failed"
    """The step was not committed; the previous committed step is intact."""


class SaveReport(NamedTuple):
    """Timings and outcome of one save on this rank (all durations in seconds)."""

    step: int
    """Training step of the save."""
    result: SaveResult
    """Committed or failed."""
    stall_s: float
    """Time the training loop was blocked: inside `save()` plus the staging fence."""
    staging_s: float
    """Snapshot copy into staging memory (runs in the background)."""
    write_s: float
    """This rank's writer: files written and durable."""
    finalize_s: float
    """Agreement across ranks and manifest commit."""
    latency_s: float
    """`save()` called until committed or failed."""
    num_bytes: int
    """Bytes this rank wrote."""
    error: str | None
    """Why the save failed, or None."""


@runtime_checkable
class SaveObserver(Protocol):
    """Receives one `SaveReport` per finished save (the daemon maps them to metrics).

    With the memory tier on, an observer may also define
    `on_memory_snapshot(step: int, num_bytes: int, seconds: float) -> None`, called on the
    training thread (at the next `save()`, `before_optimizer_step()` or `maybe_finalize()`)
    for each completed memory snapshot: its step, its payload's size, and the seconds the
    training thread spent on it (inside `save()` plus any wait for its copy at the fence). It
    is optional (looked up by name, not part of the Protocol): observers without it work
    unchanged.
    """

    def on_save_finished(self, report: SaveReport) -> None:
        """Called on the training thread when a save commits or fails."""


MEMORY_SNAPSHOT_HOOK = "on_memory_snapshot"
"""The optional `SaveObserver` method told of each completed memory snapshot."""


FINALIZE_CALLS_KEPT = 1024
"""How many recent `maybe_finalize()` call times `ManagerStats` carries."""


class ManagerStats(NamedTuple):
    """Point-in-time state of a manager."""

    inflight: int
    """Saves requested but not yet committed or failed."""
    last_committed_step: int | None
    """Newest step committed by this manager or found at start."""
    last_committed_unix_s: float | None
    """Commit time of that step (Unix seconds)."""
    recent_finalize_call_s: tuple[float, ...] = ()
    """Training-thread time of each of the last `FINALIZE_CALLS_KEPT` `maybe_finalize()`
    calls that had a save in flight, oldest first (a bench reports their p99)."""
    num_memory_snapshots: int = 0
    """Memory snapshots completed by this manager (memory tier; memory-only and durable
    saves alike)."""
    num_memory_snapshots_skipped: int = 0
    """Snapshots skipped because no slot could be taken (each reason is logged once)."""
    last_memory_snapshot_bytes: int = 0
    """Payload size of the last completed memory snapshot."""
    last_memory_save_s: float = 0.0
    """Training-thread seconds inside the last memory-only `save()` (`durable=False`)."""
    memory_staging_cpu_s: float = 0.0
    """CPU seconds the staging thread spent on the memory-only snapshots recorded so far
    (copy, checksum, meta): their cost besides the training thread's, on a machine whose
    cores all train ([Note: a snapshot's cost to the step] in `daemon/rank/loop.py`)."""
    memory_slot_allocations: int = 0
    """Memory slot files allocated (or grown) so far: one-time costs of the snapshots whose
    staging ran them (the `auto` cadence leaves those snapshots' costs out)."""
    memory_bytes_held: int = 0
    """Bytes held by this rank's memory slot files."""
    newest_memory_step: int | None = None
    """The newest step snapshotted to memory (or restored) by this manager, or None."""
    num_memory_snapshots_failed: int = 0
    """Memory snapshots that failed (a slot that could not be allocated on a full tmpfs, a
    copy or meta write that failed; durable saves' snapshots included)."""
    oldest_inflight_step: int | None = None
    """Step of the oldest save in flight (None: none)."""
    oldest_inflight_unix_s: float | None = None
    """When that save was requested (Unix seconds; None: none in flight)."""


class RestoreResult(NamedTuple):
    """What `restore()` returns."""

    step: int
    """The step restored."""
    state: Any
    """The restored state (the template's structure when `into` was given)."""
    source: str = "durable"
    """Where it came from: `"memory"` (the memory tier's slots), `"replica"` (slots a daemon
    copied from a peer node's replica before the rank started) or `"durable"` (storage)."""
    fallback_reason: str | None = None
    """Why the memory tier was not used, when it was tried (None: it was used, or not
    tried: the tier is off or an explicit step was asked for)."""


class RestoreProgress(NamedTuple):
    """How far a `restore()` has read on this rank (passed to its `on_progress` callback).

    Reported after every read from storage: each verified chunk of a file this rank checks and
    each stored piece (or 64 MiB part of one) it loads. A restore that reports nothing for a
    long time is stuck on storage, not slow.
    """

    step: int
    """The step being verified or loaded (a newer one may have been skipped before)."""
    num_bytes_read: int
    """Bytes this rank has read from storage since `restore()` began (verify + load)."""
