"""trainingd's fully sharded data-parallel engine (after Megatron-Core 0.12's custom FSDP).

Four strategies over `torch.distributed` (gloo on CPU, NCCL on CUDA): `NO_SHARD` (DDP),
`OPTIM` (ZeRO-1), `OPTIM_GRADS` (ZeRO-2), `OPTIM_GRADS_PARAMS` (ZeRO-3). It never imports
`ckpt_manager` or `daemon`; it exposes plain stats objects the daemon turns into metrics.

Usage (CONTRACTS.md has the full seam): wrap the model once, build the optimizer from the
wrapper, train as with DDP:

    model = FullyShardedDataParallel(gpt, ShardingConfig(strategy=Strategy.OPTIM_GRADS_PARAMS,
                                     unit_modules=(Block,), param_dtype=torch.bfloat16))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=3e-4)
    loss_fn(model(x), y).backward(); optimizer.clip_grad_norm_(1.0); optimizer.step()

Semantics worth knowing: every rank starts from rank 0's weights (a model built on the
`meta` device is instead materialized and initialized by every rank one unit at a time,
seeded per module name: `DeferredInit`, [Note: deferred init]); gradients are averaged
over ranks (in `reduce_dtype`, fp32 by default) into fp32 main gradients; a parameter that
gets no gradient in a step counts as a zero gradient (the optimizer still steps it, e.g.
weight decay applies); activation checkpointing works with both `torch.utils.checkpoint`
variants: with the reentrant one a unit is re-gathered for its recompute and reduced and
released right after its recomputed backward (peak gathered memory: the root unit plus two
units, `ShardingStatsSnapshot.gathered_bytes_peak`). `no_sync()` under ZeRO-2/3
reduce-scatters every micro-batch unless `ShardingConfig.no_sync_mode` says to hold whole
fp32 gradients locally (`NoSyncMode`).
Under `OPTIM` / `OPTIM_GRADS`, `optimizer.step()` issues the all-gathers of the updated
weights and returns without waiting: each unit's pre-forward of the next forward waits on
its own (the root unit's first), so the first units compute while later gathers are in
flight; anything else that reads the weights first (a parameter, state dicts,
`summon_full_params`, the next step) waits too ([Note: deferred weight gather] in
`_optimizer.py`; `model.wait_pending_weights()` waits explicitly).
Outside forward, ZeRO-3 parameters have no memory (torch calls on them raise; use
`model.summon_full_params()`); inside forward, a unit's parameters are usable only while
that unit is gathered (another unit's raise too). No parameter has a `.grad` (it raises;
the engine's optimizer clips and steps).

Hybrid sharding (HSDP, [Note: hybrid layout] in `_mesh.py`): `ShardingConfig(shard_group_size=S)`
shards across groups of S consecutive ranks and replicates across the groups; collectives
over the weights stay inside a group, each reduced gradient shard is all-reduced across the
groups, and checkpoints hold each shard once (replica 0's pieces; the others' are empty).

Mixed precision (design; details in the note in `_precision.py`): a frozen
`MixedPrecisionPolicy` after FSDP2's and Megatron's, given as
`ShardingConfig(mixed_precision=...)` (`ShardingConfig.param_dtype` stays as its shorthand):
`param_dtype` (fp32 / bf16 / fp16) for compute weights, `reduce_dtype` for gradient
collectives (bf16 halves their bytes; accumulation stays fp32), `output_dtype` for the
wrapper's outputs, `cast_forward_inputs` (floating args of the wrapper and of each unit),
`fp32_modules` (classes computing, keeping buffers, in fp32 and handing their input's dtype
back; BatchNorm by default) and `loss_scale` (`DynamicLossScale`, required by fp16: a
sharded dynamic scaler in the optimizer, `optimizer.scale_loss(loss).backward()`, overflow
checked on every shard of every rank, skipped steps, scale in the optimizer state dict). A
parameter is never silently recast from a dtype the user stored it in: the policy must
agree (or `fp32_modules` list it), else `MixedPrecisionError` names the module. Buckets are
formed per compute dtype, so one unit can hold bf16 and fp32 buckets. Buffers: floating
ones are cast like their module's parameters; `BufferSync.BROADCAST` (default) re-sends rank
0's before forwards as DDP's `broadcast_buffers=True` does, `BufferSync.RANK_LOCAL` never.

Module plan:
* `_config.py`: `Strategy` (what is sharded), `BufferSync`, `NoSyncMode`, `ShardingConfig`.
* `_precision.py`: `MixedPrecisionPolicy`, `DynamicLossScale`; per-parameter and per-buffer
  compute dtypes, the stored-dtype check, input/output casts, the hooks of fp32 modules.
* `_layout.py`: units (outermost instances of the unit classes, root unit last), buckets
  grouped by (compute dtype, requires_grad) per unit, 64-byte aligned offsets, padded rank shards.
* `_param.py`: `ManagedParameter`: the module's parameters; checks every torch call (outside
  forward, and inside it under ZeRO-3 or while a step's weight gathers are pending) against
  its bucket's `Gate` (open while the unit is gathered; a pending ZeRO-1/2 weight gather is
  waited on instead of raising) and forbids `.grad`.
* `_buffer.py`: `FlatBucket`: flat compute weights (storage resized 0 <-> full under ZeRO-3),
  fp32 main weights and fp32 main grads per strategy; gradient packing in `reduce_dtype`;
  gradients held whole by `no_sync()` (`NoSyncMode.ACCUMULATE_UNSHARDED`).
  After a ZeRO-1/2 step it keeps its weight all-gather pending until `wait_weights()`.
* `_module_buffers.py`: `ModuleBuffers`: the module's buffers, cast per policy, broadcast
  per `BufferSync`, exported in their original dtypes.
* `_mesh.py`: `HybridGroups`: the replicate x shard process groups of hybrid sharding.
* `_comm.py`: `Communicator`: async flat collectives (CUDA: on NCCL's own streams, all-gathers
  on a second group; gloo: a reduce-scatter of a scratch input as an in-place all-reduce,
  without gloo's clone), `PendingCollective.wait()` timed (CUDA: by events); local fallbacks
  at world size 1.
* `_allgather.py`: `UnshardPipeline`: SHARDED -> GATHERING -> UNSHARDED per unit, prefetch in
  forward / reverse order bounded by `communication_unit_bytes`, hit/miss and gathered-bytes
  accounting; opens a unit's gates once its gather is waited on.
* `_reduce.py`: `ReducePipeline`: reduce-scatter / all-reduce per bucket in `reduce_dtype`,
  into fp32 main grads, bounded queue (room made as a unit's backward starts: [Note: reduce
  memory]); the replica all-reduce of hybrid sharding.
* `_hooks.py`: `TrainingState`, the post-backward identity function, pre-backward hooks,
  the end-of-backward callback.
* `_engine.py`: `Engine`: the state machine IDLE -> FORWARD -> BACKWARD -> IDLE driving both
  pipelines from the hooks; reentrant checkpoint recomputes report their units' backward.
  `wait_pending_weights()`: the one wait every reader of a step's weights goes through.
* `_groups.py`: `no_decay_groups`; torch-style parameter groups resolved to element runs of
  each bucket's main weights (a shard may span several groups).
* `_scaler.py`: `ShardedLossScaler`: dynamic loss scale, one all-reduced overflow verdict
  per step, back-off / growth, its state.
* `_optimizer.py`: `DistributedOptimizer`: torch optimizer on main-weight shards, global
  norm clipping, loss scaling, pushing updated weights back (ZeRO-1/2: gathers left pending
  for the next forward); its sharded state dict (save, reshard on load).
* `_optimizer_state.py`: `materialize_state`: the optimizer's state made without a step (a
  probe step learns each group's entries), for a restore to fill in place.
* `_state_dict.py`: `ShardedTensor`, the flat form's piece helpers (resharding on load), the
  model's sharded / full state dicts (`_optimizer` imports it, never the reverse).
* `_stats.py`: `ShardingStats`, `ShardingStatsSnapshot`, `CollectiveObserver`.
* `_materialize.py`: `DeferredInit`, `MetaMaterializer`: a model built on the `meta` device
  is materialized, initialized (seeded per module name) and copied in one unit at a time.
* `_wrapper.py`: `FullyShardedDataParallel`, the public entry point.
* `errors.py`: the error tree.
"""

from sharding._config import BufferSync, NoSyncMode, ShardingConfig, Strategy
from sharding._groups import no_decay_groups
from sharding._materialize import DeferredInit
from sharding._optimizer import DistributedOptimizer
from sharding._precision import DynamicLossScale, MixedPrecisionPolicy
from sharding._state_dict import ShardedTensor
from sharding._stats import (
    CollectiveObserver,
    CollectiveTotals,
    ShardingStats,
    ShardingStatsSnapshot,
)
from sharding._wrapper import FullyShardedDataParallel

__all__ = [
    "BufferSync",
    "CollectiveObserver",
    "CollectiveTotals",
    "DeferredInit",
    "DistributedOptimizer",
    "DynamicLossScale",
    "FullyShardedDataParallel",
    "MixedPrecisionPolicy",
    "NoSyncMode",
    "ShardedTensor",
    "ShardingConfig",
    "ShardingStats",
    "ShardingStatsSnapshot",
    "Strategy",
    "no_decay_groups",
]
