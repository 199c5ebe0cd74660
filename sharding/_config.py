"""`ShardingConfig` and the `Strategy` / `BufferSync` enums: what the user chooses."""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

from sharding._materialize import DeferredInit
from sharding._precision import MixedPrecisionPolicy

__all__ = ["BufferSync", "NoSyncMode", "ShardingConfig", "Strategy"]


class Strategy(enum.Enum):
    """Which training state is sharded across the data-parallel ranks.

    | strategy | model weights | fp32 main weights + optimizer state | fp32 main grads |
    |---|---|---|---|
    | `NO_SHARD` (DDP) | whole | whole | whole, all-reduced on the last micro-batch |
    | `OPTIM` (ZeRO-1) | whole | shard | whole, reduce-scattered on the last micro-batch |
    | `OPTIM_GRADS` (ZeRO-2) | whole | shard | shard, reduce-scattered every micro-batch* |
    | `OPTIM_GRADS_PARAMS` (ZeRO-3) | shard | shard | shard, reduce-scattered every micro-batch* |

    *or held whole inside `no_sync()` and reduce-scattered once per window (`NoSyncMode`).
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def shards_optimizer(self) -> bool:
        """Whether main weights and optimizer state are sharded."""
        return self is not Strategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        """Whether main gradients are sharded (reduced every micro-batch)."""
        return self in (Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        """Whether model weights are sharded between uses (gathered per unit)."""
        return self is Strategy.OPTIM_GRADS_PARAMS


class NoSyncMode(enum.Enum):
    """What `no_sync()` does with gradients under `OPTIM_GRADS` and `OPTIM_GRADS_PARAMS`.

    `NO_SHARD` and `OPTIM` keep a whole local fp32 gradient anyway: they always accumulate
    inside `no_sync()` and reduce once, on the last micro-batch, whatever this says.
    """

    REDUCE_SCATTER = "reduce_scatter"
    """Reduce-scatter every micro-batch, `no_sync()` or not (no extra memory: gradients are
    only ever held sharded, plus each unit's whole gradients while it is being reduced).
    An accumulation window of n micro-batches costs n reduce-scatters per trained bucket."""
    ACCUMULATE_UNSHARDED = "accumulate_unsharded"
    """Inside `no_sync()`, add each trained bucket's gradients into a whole fp32 buffer
    kept on this rank; the first micro-batch outside `no_sync()` adds its own and
    reduce-scatters once. Saves n - 1 of n reduce-scatters per window; costs 4 bytes per
    trained parameter on every rank (the whole model in fp32, i.e. world size times the
    sharded fp32 gradient) from the first `no_sync()` micro-batch until that reduction."""


class BufferSync(enum.Enum):
    """What happens to module buffers (e.g. BatchNorm running statistics) after wrapping.

    Both start from rank 0's buffers (broadcast at wrap).
    """

    BROADCAST = "broadcast"
    """As DDP's `broadcast_buffers=True`: rank 0's buffers overwrite every rank's at the start
    of a forward that follows a training forward (grad enabled, not inside `no_sync`), so all
    ranks normalise with rank 0's statistics; one coalesced broadcast per buffer dtype."""
    RANK_LOCAL = "rank_local"
    """Each rank keeps updating its own buffers; they drift apart (no communication).
    State dicts save rank 0's (`full_state_dict`) or this rank's (`sharded_state_dict`)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class ShardingConfig:
    """How `FullyShardedDataParallel` shards and communicates.

    Gradients always accumulate into fp32 main gradients; `mixed_precision` chooses the
    compute, communication and output dtypes.
    """

    strategy: Strategy = Strategy.OPTIM_GRADS_PARAMS
    """What is sharded: see `Strategy`."""
    unit_modules: tuple[type[nn.Module], ...] | None = None
    """Module classes whose instances become FSDP units (outermost wins); `None` detects the
    repeated block classes (non-`torch.nn` classes with at least two instances)."""
    bucket_size_bytes: int = 40_000_000
    """Largest flat bucket for parameters outside any unit (a unit is never split)."""
    prefetch: bool = True
    """Issue the next units' all-gathers (forward and backward order) before they are needed."""
    communication_unit_bytes: int | None = None
    """All-gather prefetch budget in unsharded compute-dtype bytes, counted from the unit being
    gathered; `None` means twice the average unit size (the next unit is fetched while the
    current one runs)."""
    param_dtype: torch.dtype = torch.float32
    """Shorthand for `mixed_precision=MixedPrecisionPolicy(param_dtype=...)` (`torch.float32`
    or `torch.bfloat16`); when `mixed_precision` is given it mirrors the policy's."""
    mixed_precision: MixedPrecisionPolicy | None = None
    """Compute / reduce / output dtypes and fp32 modules; `None` is the policy of
    `param_dtype` (see `precision`)."""
    buffer_sync: BufferSync = BufferSync.BROADCAST
    """Whether buffers are re-broadcast from rank 0 before forwards (DDP's default) or stay
    rank-local: see `BufferSync`."""
    max_inflight_reductions: int = 2
    """Bound of the gradient-reduction queue: before another reduction is issued, the oldest
    is waited on once this many are in flight (ZeRO-2/3 already when a unit's backward starts,
    so that unit's fresh gradients never sit beside a full queue: [Note: reduce memory])."""
    no_sync_mode: NoSyncMode = NoSyncMode.REDUCE_SCATTER
    """Whether `no_sync()` reduce-scatters each micro-batch or accumulates whole fp32
    gradients locally under the grads-sharded strategies (memory cost: see `NoSyncMode`)."""
    deferred_init: DeferredInit = dataclasses.field(default_factory=DeferredInit)
    """Seed and init function of a model built on the `meta` device, which the wrapper
    materializes one unit at a time (see `DeferredInit`); unused for a materialized model."""
    shard_group_size: int | None = None
    """Hybrid sharding (HSDP): shard across groups of this many consecutive ranks and
    replicate across the groups (`None`: one group, the whole world). Must divide the world
    size; needs a sharded strategy and the default process group (see `sharding/_mesh.py`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise ValueError(
                f"ShardingConfig.strategy must be a sharding.Strategy, got {self.strategy!r}; "
                f"use e.g. Strategy.OPTIM_GRADS_PARAMS or Strategy('{Strategy.NO_SHARD.value}')"
            )
        if self.unit_modules is not None:
            bad = [
                c
                for c in self.unit_modules
                if not (isinstance(c, type) and issubclass(c, nn.Module))
            ]
            if bad:
                raise ValueError(
                    f"ShardingConfig.unit_modules must hold nn.Module subclasses, got {bad!r}; "
                    "pass classes such as (Block,), not instances"
                )
        if self.bucket_size_bytes <= 0:
            raise ValueError(
                f"ShardingConfig.bucket_size_bytes must be positive, got {self.bucket_size_bytes}"
            )
        if self.communication_unit_bytes is not None and self.communication_unit_bytes <= 0:
            raise ValueError(
                "ShardingConfig.communication_unit_bytes must be positive or None (twice the "
                f"average unit), got {self.communication_unit_bytes}"
            )
        policy = self.mixed_precision
        if policy is None:
            try:
                MixedPrecisionPolicy(param_dtype=self.param_dtype)
            except ValueError as err:
                raise ValueError(f"ShardingConfig.param_dtype: {err}") from None
        elif not isinstance(policy, MixedPrecisionPolicy):
            raise ValueError(
                "ShardingConfig.mixed_precision must be a sharding.MixedPrecisionPolicy or "
                f"None, got {policy!r}"
            )
        elif self.param_dtype not in (torch.float32, policy.param_dtype):
            raise ValueError(
                f"ShardingConfig.param_dtype={self.param_dtype} contradicts mixed_precision."
                f"param_dtype={policy.param_dtype}; set the dtype in the policy only"
            )
        else:
            # Frozen: the shorthand mirrors the policy so readers of `param_dtype` agree.
            object.__setattr__(self, "param_dtype", policy.param_dtype)
        if not isinstance(self.buffer_sync, BufferSync):
            raise ValueError(
                f"ShardingConfig.buffer_sync must be a sharding.BufferSync, got "
                f"{self.buffer_sync!r}; use BufferSync.BROADCAST or BufferSync.RANK_LOCAL"
            )
        if not isinstance(self.no_sync_mode, NoSyncMode):
            raise ValueError(
                f"ShardingConfig.no_sync_mode must be a sharding.NoSyncMode, got "
                f"{self.no_sync_mode!r}; use e.g. NoSyncMode.ACCUMULATE_UNSHARDED or "
                f"NoSyncMode('{NoSyncMode.REDUCE_SCATTER.value}')"
            )
        if not isinstance(self.deferred_init, DeferredInit):
            raise ValueError(
                f"ShardingConfig.deferred_init must be a sharding.DeferredInit, got "
                f"{self.deferred_init!r}; use e.g. DeferredInit(seed=0)"
            )
        if self.shard_group_size is not None:
            if isinstance(self.shard_group_size, bool) or not isinstance(
                self.shard_group_size, int
            ):
                raise ValueError(
                    "ShardingConfig.shard_group_size must be an int or None (shard over the "
                    f"whole world), got {self.shard_group_size!r}"
                )
            if self.shard_group_size < 1:
                raise ValueError(
                    "ShardingConfig.shard_group_size must be at least 1 (e.g. the ranks per "
                    f"node) or None (the whole world), got {self.shard_group_size}"
                )
            if not self.strategy.shards_optimizer:
                raise ValueError(
                    "ShardingConfig.shard_group_size needs a sharded strategy: NO_SHARD "
                    "replicates everything already; leave shard_group_size None or use "
                    "Strategy.OPTIM_GRADS_PARAMS (hybrid ZeRO-3)"
                )
        if self.max_inflight_reductions < 1:
            raise ValueError(
                "ShardingConfig.max_inflight_reductions must be at least 1, "
                f"got {self.max_inflight_reductions}"
            )

    @property
    def precision(self) -> MixedPrecisionPolicy:
        """The effective policy: `mixed_precision`, or the one of `param_dtype`."""
        return self.mixed_precision or MixedPrecisionPolicy(param_dtype=self.param_dtype)
