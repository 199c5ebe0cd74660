"""The training loop of one rank: data -> forward/backward -> step -> metrics -> checkpoint.

Composes the two engines exactly as CONTRACTS.md describes: `sharding` wraps the model and owns
the optimizer; `ckpt_manager` receives plain state dicts. The state saved at a step is

    {"model": model.sharded_state_dict(),          # ShardedTensor leaves: each rank its piece
     "optimizer": optimizer.sharded_state_dict(),
     "scheduler": scheduler.state_dict(),          # plain JSON values, replicated
     "data": loader.state_dict(),                  # global position, identical on every rank
     "rng": RankLocal({"torch": ..., "python": ...}),   # per rank
     "__model_files__": {"config.json": ...}}       # only from a --init-from with a config

and a restore puts back every piece, so a resumed run is bitwise the run that was not stopped
(CPU, fp32): same weights, optimizer moments, LR, data order and RNG streams.

[Note: one all-reduce per step agrees on stop and checkpoint]
After the optimizer step each rank all-reduces `[loss, stop, checkpoint, ..., durable busy]`
(sum). The loss becomes the global mean; a stop or checkpoint request seen by any rank is seen
by all at the same step, which the collective `save()` requires, and so is a durable write
still in flight on any rank ([Note: a durable save never stalls the loop] in `deferral.py`).
One tiny collective per step is the whole cost. With straggler detection on, one slot per rank
follows: each rank's compute time of its previous step ([Note: compute time rides on the
per-step agreement] in `stragglers.py`).

[Note: one host read per step] Reading a device tensor on the host (`float(loss)`, `.item()`)
blocks until the GPU has caught up, so the host cannot queue the next kernels ahead of it. The
micro-batch losses are summed on the device; the agreed `[loss, stop, checkpoint]` and the
gradient norm come back together in one `.tolist()` after the all-reduce, the step's only
read (the stop decision needs it every step). `tests/daemon/rank/test_loop_host_syncs.py` counts.

[Note: the memory tier in the loop] With `memory_every` on (and the daemon's tier directory
present, on every rank: the ranks agree, else all train durable-only), every save also lands in
the rank's memory slot, and between durable saves the loop snapshots into memory alone
(`save(..., durable=False)`) when the cadence (`memory_cadence.py`) says so. The cadence is
fed values every rank agrees on: the step time and the snapshot's cost ([Note: a snapshot's
cost to the step]) ride on the per-step all-reduce (their means), one step late. A failed
memory snapshot (`MemorySnapshotError`: a full tmpfs) is logged and counted, and training goes
on: a step some rank lacks is never agreed on for a memory restore. A restart restores from
memory first (`RestoreResult.source`).

[Note: a snapshot's cost to the step] What a memory snapshot costs the training thread (its
stall, `trainingd_memory_snapshot_seconds`) is the `save()` call plus the wait at the next
optimizer-step fence. The cadence is fed that plus the staging thread's CPU time for it
(`ManagerStats.memory_staging_cpu_s`: copy, checksum, meta): where every core trains (a CPU
job, or one rank per core) that time is taken from some rank, and the step, which waits for
the slowest rank in its all-reduce, grows by about as much. On the 2-core VM a default-job
snapshot stalls the training thread ~5 ms and takes the staging thread ~4 ms of CPU
(`bench/snapshot_stall.py`): fed the stall alone, `auto` counted half the cost and aimed at
an interval of some 3 steps of 125 ms. Where cores are idle the staging time costs no step, so
`auto` errs towards a longer interval there. Staging time that arrives after its snapshot
was fed is fed with the next one. The stall alone rides along too: the cadence adds it to what
the step after the snapshot measurably lost ([Note: a snapshot's cost is also measured in the
step after it] in `memory_cadence.py`).

[Note: a slot's allocation is not a snapshot's cost] A rank's first snapshots allocate its slot
files (`posix_fallocate` of the state's size, then a mapping: 0.18-0.32 s for the 256 MiB job's
134 MB slots on the 2-core VM), inside their staging, so the fence waits for it and the staging
CPU counts it. Fed as a snapshot's cost, that one-time cost made `auto` jump from 10 to an
interval of 68-87 after the first snapshot of that job, where about 10 was right, and stay
there for hundreds of steps (a moving average moves only at each snapshot). A snapshot during
which a slot file was allocated (`ManagerStats.memory_slot_allocations` changed between its
`save()` and its fence) is therefore sent as NaN in the per-step all-reduce: every rank's
agreed cost is then NaN, and the cadence leaves that snapshot and the step after it out. Since
the loop has the manager allocate the configured slots after a life's first step
(`reserve_memory`: [Note: the first slots allocated ahead] in `ckpt_manager/_save/snapshots.py`),
that is a snapshot taken before those allocations are done (`memory_every 1`), or one that
grows a slot or takes an extra one.

Checkpoint calls go through `SaveFailurePolicy` (`save_failures.py`): a failed save is
reported and training continues, until `max_consecutive_save_failures` in a row stop the run.
The final save of the drain is retried once and must commit, else the run fails. A durable save
due while an earlier one is still being written is deferred, not waited for (`deferral.py`).

On CUDA (`device`, see `daemon/_device.py`) the model lives on the rank's GPU before the engine
wraps it, batches come from pinned host memory and are copied with `non_blocking=True` (the
copy overlaps the host's work on the next micro-batch), and the per-step agreement tensor lives
on the device, as NCCL requires. The CUDA RNG state is saved with the CPU one.

With `eval_every` on, a due step measures the validation loss after its metrics and before
its checkpoint (`evaluation.py`: forwards only, one all-reduce); a save of that step carries it
as `val_loss` beside `loss`, for `KeepBest` (a deferred save, taken at a later step, does not).

A run that reached `max_steps` ends with the job's `sample` (if it has one): every rank takes
part in gathering the full weights (`full_state_dict`, collective), rank 0 calls the hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import structlog
import torch
import torch.distributed as dist

from daemon.config import DaemonConfig
from daemon.jobs.init_from import (
    InitSource,
    check_source,
    expected_tensors,
    load_into,
    storage_options_for,
)
from daemon.jobs.job import JobSpec, fp32_module_classes
from daemon.jobs.model_files import MODEL_FILES_KEY, read_model_files
from daemon.rank.batch import Batch, forward_loss, num_tokens, to_device
from daemon.rank.data import ShardedLoader
from daemon.rank.deferral import DeferredSaves
from daemon.rank.evaluation import Evaluator
from daemon.rank.memory_cadence import Cadence, FixedCadence, cadence_for
from daemon.rank.prefetch import PrefetchingLoader
from daemon.rank.save_failures import SaveFailurePolicy
from daemon.rank.stragglers import StragglerProbe
from daemon.rank.telemetry import NullTelemetry, RankTelemetry
from daemon.rank.throughput import gpu_memory, mfu_ratio, peak_flops
from daemon.rundir.control import RankControl
from daemon.rundir.progress import ProgressPhase
from daemon.rundir.snapshot import RankPhase

if TYPE_CHECKING:
    from sharding import DistributedOptimizer, FullyShardedDataParallel

__all__ = ["LoopResult", "make_optimizer", "run_training"]

log = structlog.get_logger("trainingd.loop")

_T = TypeVar("_T")
_MEMORY_FAILURE_RETRIES = 3
"""Memory-snapshot failures one checkpoint call may report before it runs (each is one older
snapshot's; at most the tier's slots plus the saves in flight are pending at once)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class LoopResult:
    """How a rank's training loop ended."""

    start_step: int
    """Step restored from (0 for a fresh run)."""
    final_step: int
    """Last completed step."""
    stopped: bool
    """True when a stop request ended the loop before `max_steps`."""
    last_loss: float | None
    """Global mean loss of the last step run by this process."""
    num_tokens: int
    """Tokens this rank trained on in this process (for the run's tokens/s summary)."""
    sample: str | None = None
    """The job's `sample` of the trained model (rank 0 of a run that reached `max_steps`)."""


def _lr_lambda(cfg: DaemonConfig) -> Any:
    warmup, total = cfg.train.warmup_steps, max(cfg.train.max_steps, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _rng_state(device: torch.device) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    # A checkpoint written on the CPU has no CUDA stream: the device keeps its seeded one.
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))


def _freeze_setup_objects() -> None:
    """Collect once, then move every object alive into the collector's permanent generation.

    [Note: the setup's objects are frozen before the first step] A rank holds some 10^5-10^6
    container objects from its imports and setup (torch, the model, the job), all long-lived.
    CPython's full collection scans every tracked object, so each one cost the training
    thread 40 ms (quiet 2-core VM) to 190 ms (loaded); one runs whenever the objects
    promoted since the last one reach a quarter of the long-lived ones, which the memory
    tier's snapshots (a few thousand objects each, alive while the staging thread copies)
    hastened: the p99 of `trainingd_memory_snapshot_seconds` was such a collection run
    inside a snapshot (`bench/snapshot_stall.py`: the `gc` part). `gc.freeze()` leaves
    those objects out of every later collection, so a full collection scans only what
    training created. Frozen objects are never collected: the young generations (the setup's
    and the restore's temporaries) are collected first, not the whole heap, which would be
    one more full collection (40 ms to seconds under load) on a restarted rank's way to its
    first step; the rare garbage that already reached the oldest generation stays.
    `run_training` unfreezes them when it ends (a process may train again).
    """
    gc.collect(1)
    gc.freeze()


def _memory_tier_available(cfg: DaemonConfig) -> bool:
    """Whether this rank can use the memory tier: on in the config and its directory exists.

    The daemon creates the directory at start (`daemon/agent/memory_dir.py`); under a plain
    `torchrun` no daemon owns one, and the rank trains durable-only.
    """
    if cfg.checkpoint.memory_every.is_off:
        return False
    if cfg.memory_tier_dir.is_dir():
        return True
    log.warning(
        "memory_tier_unavailable",
        memory_dir=str(cfg.memory_tier_dir),
        reason="no daemon created this node's memory-tier directory: durable checkpoints only",
    )
    return False


def _agree_all(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank (collective)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0)


def _agree_any(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on some rank (collective)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _checkpoint_config(cfg: DaemonConfig, *, memory: bool = False, restart: int = 0) -> Any:
    from ckpt_manager import CheckpointConfig, MemoryTierConfig, S3Options
    from daemon._storage import s3_storage_options

    ck = cfg.checkpoint
    # `trainingd-rank/<restart>.<pid>`: an access log tells a restarted group's reads from
    # those of the group it replaced, still winding down.
    options = s3_storage_options(cfg, f"rank/{restart}.{os.getpid()}")
    return CheckpointConfig(
        memory=MemoryTierConfig(directory=str(cfg.memory_tier_dir)) if memory else None,
        async_mode=ck.async_mode,
        staging_nice=ck.staging_nice,
        # The `keep_*` keys, read by ckpt_manager's registry (None: keep every checkpoint).
        retention=ck.retention.policy(),
        storage_options=options,
        # Only S3 gains from spreading; None keeps plain names on every other root.
        spread_prefixes=ck.s3_spread_prefixes if S3Options.serves(ck.ckpt_uri) else None,
    )


def _checkpoint_exists(manager: Any) -> bool:
    # Rank 0 decides, so every rank takes the same path through the collectives below.
    flag = [manager.latest_step() is not None if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def make_optimizer(
    model: FullyShardedDataParallel, *, lr: float, weight_decay: float
) -> DistributedOptimizer:
    """AdamW over the wrapped model in two groups (`sharding.no_decay_groups`).

    Matrices decay by `weight_decay`; biases, norm weights and embeddings (a tied LM head
    included) do not, as GPT-2/nanoGPT train. Both groups are saved with the optimizer
    state, so a resume restores them exactly.
    """
    from sharding import no_decay_groups

    groups = no_decay_groups(model, weight_decay)
    return model.make_optimizer(torch.optim.AdamW, groups, lr=lr, weight_decay=weight_decay)


def _materialize_optimizer_state(optimizer: Any) -> bool:
    """Give the optimizer its state tensors so a restore template has places for them.

    [Note: the restore template needs optimizer state] `restore(into=template)` fills only the
    leaves the template has, and a torch optimizer creates its state (AdamW: step, exp_avg,
    exp_avg_sq) lazily at its first step: a template taken before any step would silently
    restore no optimizer state. `DistributedOptimizer.materialize_state` makes the state a
    step would, without one ([Note: optimizer state made for a restore] in
    `sharding/_optimizer_state.py`): no forward, backward, collective or weight update, no RNG
    drawn, and the template's pieces are views of the live state, so the restore writes
    straight into it and the load copies nothing (the restart's critical path:
    [Note: the recovery timeline] in `bench/recovery_timeline.py`). When the restore finds
    nothing after all (memory slots that do not verify, no durable step),
    `_forget_optimizer_state` leaves exactly a fresh start.

    Returns:
        Whether it made the state (an optimizer that makes its own when built has it).
    """
    return bool(optimizer.materialize_state())


def _forget_optimizer_state(optimizer: Any) -> None:
    """Drop the state `_materialize_optimizer_state` created (a fresh start after all)."""
    optimizer.optimizer.state.clear()


def _init_source(cfg: DaemonConfig, job: JobSpec, expected: dict[str, Any]) -> InitSource | None:
    """The checked `--init-from` / `JobSpec.init_from` source, or None (`jobs/init_from.py`)."""
    uri = cfg.train.init_from or job.init_from
    if not uri:
        return None
    options = storage_options_for(uri, cfg.checkpoint.s3_endpoint_url)
    return check_source(expected, uri, job.init_key_map, options)


def _model_files(cfg: DaemonConfig, job: JobSpec, rank: int) -> dict[str, Any]:
    """`{MODEL_FILES_KEY: {name: text}}` of the init source's `config.json` etc., or `{}`."""
    uri = cfg.train.init_from or job.init_from
    if not uri:
        return {}
    files = read_model_files(uri, storage_options_for(uri, cfg.checkpoint.s3_endpoint_url))
    if not files and rank == 0:
        log.warning("init_from_has_no_config", uri=uri, note="exports will have no config.json")
    return {MODEL_FILES_KEY: files} if files else {}


def run_training(
    cfg: DaemonConfig,
    job: JobSpec,
    *,
    telemetry: RankTelemetry | NullTelemetry,
    control: RankControl,
    device: torch.device | None = None,
) -> LoopResult:
    """Train this rank until `max_steps` or an agreed stop; the process group must exist.

    Args:
        cfg: the effective configuration.
        job: model, data and loss from the job callable.
        telemetry: where metrics go (`NullTelemetry`: record nothing).
        control: stop and checkpoint requests.
        device: where the model and batches live (None: the CPU); on CUDA the process group
            must be NCCL and `torch.cuda.set_device(device)` done.
    """
    run = _Training(cfg, job, telemetry, control, torch.device("cpu") if device is None else device)
    log.debug("training_built")
    with run.manager, run.loader:  # the loader's prefetch thread ends with the run
        try:
            run.restore_or_initialize()
            run.start()
            if run.step < cfg.train.max_steps and not run.stopped:
                run.train_step()
                log.debug("first_step_done", step=run.step)
            while run.step < cfg.train.max_steps and not run.stopped:
                run.train_step()
            run.drain()
        except BaseException:
            # Unwinding (a peer died under a collective, the job raised): the manager's close
            # may take a while, and it is not the stall the rank was in ([Note: a stall that
            # ends during the stack dump] in `daemon/agent/hang.py`).
            telemetry.mark(ProgressPhase.EXITED)
            raise
        finally:
            gc.unfreeze()  # [Note: the setup's objects are frozen before the first step]
    # The job's sample of the trained model (a completed run only).
    sample = None
    if not run.stopped and job.sample is not None:
        sample = _sample(run.model, job, run.rank)
    return LoopResult(
        start_step=run.start_step,
        final_step=run.step,
        stopped=run.stopped,
        last_loss=run.last_loss,
        num_tokens=run.num_tokens,
        sample=sample,
    )


class _Agreement(NamedTuple):
    """What every rank agreed on after a step.

    See [Note: one all-reduce per step agrees on stop and checkpoint].
    """

    loss: float
    """Global mean loss of the step."""
    stop: bool
    """Some rank was asked to stop."""
    checkpoint: bool
    """Some rank was asked for a checkpoint."""
    grad_norm: float
    """Global gradient norm before clipping (read in the same host read)."""
    step_s: float = 0.0
    """Mean over ranks of the previous step's time without snapshot costs (0 before the
    first); [Note: the memory tier in the loop]."""
    snapshot_s: float = 0.0
    """Mean over ranks of the last memory snapshot's cost: training-thread stall plus staging
    CPU time ([Note: a snapshot's cost to the step]; 0: none)."""
    snapshot_stall_s: float = 0.0
    """Mean over ranks of the last memory snapshot's training-thread stall alone (0: none)."""
    durable_busy: bool = False
    """Some rank's durable save in flight is still being written: a durable `save()` now
    would wait for it ([Note: a durable save never stalls the loop] in `deferral.py`)."""


class _Training:
    """One rank's training run: the engines it built and where it is; `run_training` drives it.

    Building it wraps the model (`sharding`), makes the optimizer, LR schedule, loader and
    checkpoint manager; each method is one stage of the loop, in the order `run_training`
    calls them.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        job: JobSpec,
        telemetry: RankTelemetry | NullTelemetry,
        control: RankControl,
        device: torch.device,
    ) -> None:
        from ckpt_manager import CheckpointManager
        from sharding import (
            DeferredInit,
            FullyShardedDataParallel,
            MixedPrecisionPolicy,
            ShardingConfig,
            Strategy,
        )

        tc = cfg.train
        self.cfg, self.job, self.device = cfg, job, device
        self.telemetry, self.control = telemetry, control
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Elastic jobs keep the global batch at any world size ([Note: an elastic job keeps its
        # global batch] in `daemon/config.py`); fixed ones accumulate `micro_batches`.
        self.micro_batches = cfg.micro_batches_at(self.world)
        # The validation loss (`evaluation.py`); its value at a step goes into that step's save.
        self.evaluator = Evaluator(
            job,
            every=tc.eval_every,
            max_steps=tc.max_steps,
            batch_size=tc.batch_size,
            # An elastic job evaluates the same samples at any world size, as it trains the
            # same global batch ([Note: an elastic job keeps its global batch]).
            num_batches=tc.eval_batches * self.micro_batches // tc.micro_batches,
            rank=self.rank,
            world_size=self.world,
            device=device,
            telemetry=telemetry,
        )
        # `--init-from` weights are checked against the unsharded model's tensors, taken here.
        self._init_expected = expected_tensors(job.model) if tc.init_from or job.init_from else {}
        # The init source's config.json etc., saved with every step (`jobs/model_files.py`).
        self.model_files = _model_files(cfg, job, self.rank)
        precision = MixedPrecisionPolicy(
            param_dtype=getattr(torch, tc.param_dtype.value),
            reduce_dtype=getattr(torch, tc.reduce_dtype.value),
            output_dtype=torch.float32,  # the job's loss sees fp32 logits
            fp32_modules=fp32_module_classes(job.model, tc.fp32_modules),
        )
        # A meta-device model is materialized by the engine, unit by unit, on `device`.
        on_meta = any(p.is_meta for p in job.model.parameters())
        self.model = FullyShardedDataParallel(
            job.model if on_meta else job.model.to(device),
            ShardingConfig(
                strategy=Strategy(tc.strategy.engine_strategy),
                # [Note: hybrid by default across nodes] in `daemon/config.py`.
                shard_group_size=cfg.shard_group_size_at(self.world),
                unit_modules=job.unit_modules,
                max_inflight_reductions=tc.max_inflight_reductions,
                mixed_precision=precision,
                deferred_init=DeferredInit(seed=tc.seed, init_fn=job.init_fn),
            ),
            device=device,
            observer=telemetry,
        )
        self.optimizer = make_optimizer(self.model, lr=tc.lr, weight_decay=tc.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, _lr_lambda(cfg)
        )
        self.loader = PrefetchingLoader(
            ShardedLoader(
                job.train_data,
                batch_size=tc.batch_size,
                rank=self.rank,
                world_size=self.world,
                seed=tc.seed,
                pin_memory=device.type == "cuda",
            ),
            depth=tc.data_prefetch,
            device=device,
        )
        self.memory_tier = _agree_all(_memory_tier_available(cfg), device)
        self.cadence: Cadence = (
            cadence_for(cfg.checkpoint.memory_every, peer_replicas=cfg.num_memory_replicas > 0)
            if self.memory_tier
            else FixedCadence(0)
        )
        self.manager = CheckpointManager(
            cfg.checkpoint.ckpt_uri,
            _checkpoint_config(cfg, memory=self.memory_tier, restart=telemetry.restart),
            run_id=cfg.run_id,
            observer=telemetry,
        )
        self.tokens_per_step = tc.batch_size * self.micro_batches * job.tokens_per_sample
        # [Note: MFU] in `daemon/rank/throughput.py`: None (no peak known) exports no MFU.
        self.peak = peak_flops(device, tc.peak_flops) if job.flops_per_token > 0 else None
        self.step = self.start_step = self.saved_step = 0
        self.last_loss: float | None = None
        self.stopped = False
        self.num_tokens = 0
        # Where the restored state came from (`memory`, `replica`, `durable`); None: nothing.
        self.restore_source: str | None = None
        # [Note: the memory tier in the loop]: this rank's last step time and the cost of its
        # last memory snapshot, agreed on (means) in the next step's all-reduce.
        self._last_step_s = 0.0
        self._snapshot_cost_s = 0.0
        self._snapshot_step: int | None = None
        self._snapshot_counted = True  # the pending snapshot is one of the cadence's
        # [Note: a snapshot's cost to the step]: the staging CPU time of the pending snapshot,
        # and the manager's running total of it already fed to the cadence.
        self._snapshot_staging_s = 0.0
        self._staging_cpu_fed_s = 0.0
        # Whether a slot file was allocated between the pending snapshot's `save()` and its
        # fence, and the manager's count of allocations at that `save()` ([Note: a slot's
        # allocation is not a snapshot's cost]).
        self._snapshot_allocated = False
        self._allocations_seen = 0
        self.deferred = DeferredSaves(telemetry)
        # [Note: compute time rides on the per-step agreement] in `stragglers.py`.
        self.stragglers = StragglerProbe(
            cfg.observability,
            rank=self.rank,
            world_size=self.world,
            # The daemon's node rank, as its own lines and the hang detector label a node
            # (c10d's group rank may differ); plain torchrun has only the group rank.
            node=(
                int(os.environ.get("GROUP_RANK", "0"))
                if isinstance(telemetry, NullTelemetry)
                else cfg.launch.node_rank
            ),
            telemetry=telemetry,
            device=device,
        )

    def state(self) -> dict[str, Any]:
        """The state saved at a step (see the module docstring)."""
        from ckpt_manager import RankLocal

        return {
            "model": self.model.sharded_state_dict(),
            "optimizer": self.optimizer.sharded_state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": RankLocal(_rng_state(self.device)),
            **self.model_files,
        }

    # --- before the first step ----------------------------------------------------------------
    def restore_or_initialize(self) -> None:
        """Restore the latest committed checkpoint, else load `--init-from` weights if any."""
        from ckpt_manager import RankLocal

        telemetry, manager = self.telemetry, self.manager
        telemetry.heartbeat(RankPhase.RESTORING)
        t0 = time.perf_counter()
        # Memory may hold a step when storage holds none (the tier outlives a rank).
        in_memory = _agree_any(bool(manager.memory_steps()), self.device)
        materialized = (in_memory or _checkpoint_exists(manager)) and (
            _materialize_optimizer_state(self.optimizer)
        )
        # [Note: ranks beat while restoring] Every read from storage beats the heartbeat
        # behind /healthz (published at most every `publish_interval_s`), so a restore of any
        # length stays healthy while bytes arrive, and one stuck in a read goes stale after
        # `heartbeat_timeout_s`; the supervisor extends systemd's start timeout on the same beats.
        template = self.state()
        template.pop(MODEL_FILES_KEY, None)  # a plain value, and older steps lack it
        log.debug("restore_template_made", in_memory=in_memory, materialized=materialized)
        restored = manager.restore(
            step=None, into=template, on_progress=lambda _progress: telemetry.heartbeat()
        )
        if restored is not None:
            self.step = restored.step
            self.model.load_sharded_state_dict(restored.state["model"])
            self.optimizer.load_sharded_state_dict(restored.state["optimizer"])
            self.scheduler.load_state_dict(restored.state["scheduler"])
            self.loader.load_state_dict(restored.state["data"])
            rng = restored.state["rng"]
            rng = rng.value if isinstance(rng, RankLocal) else rng
            if rng is not None:
                _set_rng_state(rng, self.device)
            self.restore_source = restored.source
            restore_s = time.perf_counter() - t0
            log.info(
                "restored",
                ckpt_step=self.step,
                source=self.restore_source,
                fallback_reason=restored.fallback_reason,
                seconds=round(restore_s, 3),
            )
            telemetry.observe("trainingd_ckpt_restore_seconds", restore_s, self.restore_source)
        elif materialized:
            _forget_optimizer_state(self.optimizer)
        if (
            restored is None
            and (init := _init_source(self.cfg, self.job, self._init_expected)) is not None
        ):
            init_bytes = load_into(self.model, init)
            log.info("initialized_from", uri=init.source.uri, num_bytes=init_bytes)
        self.start_step = self.saved_step = self.step

    def start(self) -> None:
        """Report the start of training and agree on a stop requested before the first step."""
        _freeze_setup_objects()
        telemetry = self.telemetry
        # Counts failures from the restored state on (it reads the manager's last commit).
        self.failures = SaveFailurePolicy(
            self.manager, self.cfg.checkpoint.max_consecutive_save_failures
        )
        telemetry.set("trainingd_ckpt_consecutive_save_failures", self.failures.consecutive)
        telemetry.set("trainingd_train_step", self.step)
        telemetry.heartbeat(RankPhase.TRAINING)
        log.info(
            "training",
            start_step=self.step,
            max_steps=self.cfg.train.max_steps,
            world_size=self.world,
            shard_group_size=self.model.shard_group_size,
            micro_batches=self.micro_batches,
        )
        # A stop requested before the first step (e.g. during a restart of the group while the
        # node drains) ends the run here, at the restored step, without training further.
        early = torch.tensor([float(self.control.stop_requested())], device=self.device)
        dist.all_reduce(early)
        self.stopped = bool(early[0] > 0)
        if self.stopped:
            log.info("stopping", step=self.step, signal=self._stop_signal())

    def _stop_signal(self) -> str | None:
        """The signal that asked for the agreed stop. A rank may learn of the stop from its
        peers' flags before its own poll saw the daemon's stop file (written once, before the
        first rank saw it): reading the file again names the signal on every rank."""
        self.control.stop_requested()
        return self.control.stop_signal

    # --- one step -----------------------------------------------------------------------------
    def train_step(self) -> None:
        """Data -> forward/backward -> optimizer step -> agreement -> metrics -> checkpoint."""
        mark = self.telemetry.mark  # the progress word (see `daemon/rundir/progress.py`)
        step_start = time.perf_counter()
        mark(ProgressPhase.DATA, self.step)
        batches = self.next_batches()
        data_s = time.perf_counter() - step_start
        loss_sum = self.forward_backward(batches)
        mark(ProgressPhase.OPTIMIZER)
        grad_norm, lr = self.optimizer_step()
        mark(ProgressPhase.COLLECTIVE, self.step)
        agreed = self.agree(loss_sum, grad_norm)
        self.last_loss, self.stopped = agreed.loss, agreed.stop
        step_s = time.perf_counter() - step_start
        self._feed_cadence(agreed, step_s)
        self.stragglers.step_done(self._last_step_s, self.model.stats.snapshot())
        self.record_step(batches, agreed, lr=lr, data_s=data_s, step_s=step_s)
        self.evaluator.maybe_evaluate(self.model, self.step)  # the eval hook (when due)
        mark(ProgressPhase.CHECKPOINT)
        # [Note: a blocked checkpoint call says checkpointing] in `daemon/rank/phase_watch.py`.
        with self.telemetry.in_phase(RankPhase.CHECKPOINTING):
            self.maybe_checkpoint(agreed)
        self.telemetry.heartbeat()
        max_steps = self.cfg.train.max_steps
        if self.rank == 0 and (self.step % 10 == 0 or self.step == max_steps):
            loss = round(agreed.loss, 4)
            log.info("step", step=self.step, loss=loss, lr=lr, step_s=round(step_s, 4))
        if self.stopped:
            log.info("stopping", step=self.step, signal=self._stop_signal())

    def next_batches(self) -> list[Batch]:
        """This step's micro-batches, on the device (copies from pinned memory overlap)."""
        return [to_device(self.loader.next_batch(), self.device) for _ in range(self.micro_batches)]

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches (reduced on the last); the loss sum.

        The loss stays on the device ([Note: one host read per step]).
        """
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                self.telemetry.mark(ProgressPhase.FORWARD)
                loss = forward_loss(self.model, self.job.loss_fn, batch) / len(batches)
                self.telemetry.mark(ProgressPhase.BACKWARD)
                loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach()
        return loss_sum

    def optimizer_step(self) -> tuple[torch.Tensor, float]:
        """Clip, step the optimizer and the LR schedule; the gradient norm and the LR used."""
        tc = self.cfg.train
        with self.stragglers.waiting():  # an all-reduce `sharding` does not time
            grad_norm = self.optimizer.clip_grad_norm_(
                tc.grad_clip if tc.grad_clip > 0 else math.inf
            )
        lr = float(self.scheduler.get_last_lr()[0])
        fence_start = time.perf_counter()
        # An async save's snapshot copy must be done before the weights change.
        self._tolerate_memory_failure(self.manager.before_optimizer_step)
        if self._snapshot_step is not None:
            self._snapshot_cost_s += time.perf_counter() - fence_start
            stats = self.manager.stats()
            staged = stats.memory_staging_cpu_s
            self._snapshot_staging_s = max(staged - self._staging_cpu_fed_s, 0.0)
            self._staging_cpu_fed_s = staged
            self._snapshot_allocated = stats.memory_slot_allocations != self._allocations_seen
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.step += 1
        return grad_norm, lr

    def agree(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> _Agreement:
        """All-reduce the loss and the stop and checkpoint requests; one host read for all.

        See [Note: one all-reduce per step agrees on stop and checkpoint].
        """
        stop_local, ckpt_local = self.control.poll()
        busy_local = self.manager.write_in_flight()
        # [Note: one host read per step]; a pageable host->device copy with non_blocking
        # is staged at once, without waiting for the stream (a blocking one would).
        cost, stall = self._snapshot_cost_s + self._snapshot_staging_s, self._snapshot_cost_s
        if self._snapshot_allocated:
            # [Note: a slot's allocation is not a snapshot's cost]: NaN in any rank's sum
            # makes the agreed cost NaN on every rank, which the cadence leaves out.
            cost = stall = math.nan
        flags = torch.tensor(
            [
                float(stop_local),
                float(ckpt_local),
                self._last_step_s,
                cost,
                stall,
                float(busy_local),
                *self.stragglers.slots(),  # one per rank, after the fixed fields
            ]
        )
        agreed = torch.cat([loss_sum.float().reshape(1), flags.to(self.device, non_blocking=True)])
        with self.stragglers.waiting():
            dist.all_reduce(agreed)
        values = torch.cat([grad_norm.float().reshape(1), agreed]).tolist()
        grad_norm_value, loss_total, stop_count, ckpt_count, step_s_sum, snapshot_sum = values[:6]
        stall_sum, busy_count = values[6:8]
        self.stragglers.observe(values[8:])
        return _Agreement(
            loss=loss_total / self.world,
            stop=stop_count > 0,
            checkpoint=ckpt_count > 0,
            grad_norm=grad_norm_value,
            step_s=step_s_sum / self.world,
            snapshot_s=snapshot_sum / self.world,
            snapshot_stall_s=stall_sum / self.world,
            durable_busy=busy_count > 0,
        )

    def record_step(
        self,
        batches: list[Batch],
        agreed: _Agreement,
        *,
        lr: float,
        data_s: float,
        step_s: float,
    ) -> None:
        """The step's metrics: progress, timings, tokens, MFU, memory, loss, engine stats."""
        telemetry = self.telemetry
        telemetry.inc("trainingd_train_steps_total")
        telemetry.set("trainingd_train_step", self.step)
        telemetry.observe("trainingd_train_step_duration_seconds", step_s)
        telemetry.observe("trainingd_train_data_loading_seconds", data_s)
        step_tokens = self.tokens_per_step or sum(num_tokens(b) for b in batches)
        self.num_tokens += step_tokens
        telemetry.inc("trainingd_train_tokens_total", step_tokens)
        telemetry.set("trainingd_train_tokens_per_second", step_tokens / step_s)
        if self.peak is not None:
            mfu = mfu_ratio(step_tokens / step_s, self.job.flops_per_token, self.peak)
            telemetry.set("trainingd_train_mfu_ratio", mfu)
        for name, num_bytes in gpu_memory(self.device).items():
            telemetry.set(name, num_bytes)
        telemetry.set("trainingd_train_loss", agreed.loss)
        telemetry.set("trainingd_train_grad_norm", agreed.grad_norm)
        telemetry.set("trainingd_train_learning_rate", lr)
        if self.step == self.start_step + 1:
            recovery = time.time() - telemetry.started_unix_s
            telemetry.set("trainingd_rank_recovery_seconds", recovery)
            if self.restore_source is not None:
                telemetry.observe(
                    "trainingd_rank_restart_recovery_seconds", recovery, self.restore_source
                )
        telemetry.update_sharding(self.model.stats.snapshot())

    def maybe_checkpoint(self, agreed: _Agreement) -> None:
        """Save when due (schedule, request, stop, last step) or owed; let finished saves
        commit. A due save is deferred while an earlier one is still being written
        ([Note: a durable save never stalls the loop] in `deferral.py`)."""
        every, step = self.cfg.checkpoint.ckpt_every, self.step
        final = agreed.stop or step == self.cfg.train.max_steps
        due = bool(every and step % every == 0) or agreed.checkpoint or final
        if (due or self.deferred.owed) and agreed.durable_busy and not final:
            self.deferred.defer(step, self.manager.stats(), due=due)
            # The newest state goes to memory instead (at the deferred step, then on cadence).
            if self.memory_tier and self.cadence.due(step):
                self.snapshot_to_memory(step)
            elif self.memory_tier and due:
                self.snapshot_to_memory(step, counted=self.cadence.counts_durable_save(step))
        elif due or self.deferred.owed:
            # [Note: under `auto` a durable save between two snapshots stays on its node] in
            # `memory_cadence.py`.
            counted = not self.memory_tier or self.cadence.counts_durable_save(step)
            self.failures.guard(
                functools.partial(
                    self._tolerate_memory_failure,
                    functools.partial(
                        self.manager.save,
                        step,
                        self.state(),
                        metrics=self.metrics(agreed.loss),
                        replicate=counted,
                    ),
                )
            )
            self.saved_step = step
            self.deferred.taken(step)
            if self.memory_tier:  # the durable save snapshotted the state into memory too
                self.cadence.observe_durable_save(step, counted=counted)
            log.info("checkpoint_scheduled", ckpt_step=step, loss=round(agreed.loss, 4))
        elif self.memory_tier and self.cadence.due(step):
            self.snapshot_to_memory(step)
        if self.memory_tier and step == self.start_step + 1:
            # Once per life ([Note: the first slots allocated ahead] in
            # `ckpt_manager/_save/snapshots.py`).
            self._reserve_memory_slots()
        self.failures.guard(
            functools.partial(self._tolerate_memory_failure, self.manager.maybe_finalize)
        )
        self.telemetry.update_checkpoints(self.manager.stats())
        self.telemetry.set("trainingd_ckpt_consecutive_save_failures", self.failures.consecutive)

    def metrics(self, loss: float) -> dict[str, float]:
        """The metrics saved with the current step: its loss, and `val_loss` when it was
        evaluated (`KeepBest` ranks only steps that have its metric)."""
        last = self.evaluator.last
        if last is not None and last[0] == self.step:
            return {"loss": loss, "val_loss": last[1]}
        return {"loss": loss}

    def _reserve_memory_slots(self) -> None:
        """After a life's first step (the optimizer's state now exists, the state has its
        size), have the manager allocate the memory slots ahead of the snapshots that take
        them. A refusal is logged, not raised: the snapshots allocate them then."""
        from ckpt_manager import CheckpointError

        try:
            self.manager.reserve_memory(self.state())
        except (CheckpointError, TypeError, ValueError) as err:
            log.warning("memory_slots_not_reserved", error=str(err))

    def snapshot_to_memory(self, step: int, *, counted: bool = True) -> None:
        """Snapshot the state into the memory tier alone ([Note: the memory tier in the loop]).

        Args:
            step: the step.
            counted: one of the cadence's snapshots (replicated, its cost fed to the cadence);
                False: the newest state of a deferred durable save, kept on this node like
                the durable save it stands in for ([Note: under `auto` a durable save between
                two snapshots stays on its node] in `memory_cadence.py`).
        """
        # Only an allocation from here to the fence is this snapshot's: one made ahead (a
        # slot reserved, or allocated after the previous copy) is not.
        self._allocations_seen = self.manager.stats().memory_slot_allocations
        started = time.perf_counter()
        self._tolerate_memory_failure(
            functools.partial(
                self.manager.save, step, self.state(), durable=False, replicate=counted
            )
        )
        self._snapshot_cost_s = time.perf_counter() - started
        self._snapshot_step = step
        self._snapshot_counted = counted
        if not counted:
            self.cadence.observe_durable_save(step, counted=False)

    def _feed_cadence(self, agreed: _Agreement, step_s: float) -> None:
        """Hand the cadence what every rank agreed on; note this step for the next one."""
        if agreed.step_s > 0:
            # The agreed time is the previous step's (each rank sends its last step's time).
            self.cadence.observe_step(self.step - 1, agreed.step_s)
        if self._snapshot_step is not None:
            if self._snapshot_counted:
                self.cadence.observe_snapshot(
                    self._snapshot_step, agreed.snapshot_s, agreed.snapshot_stall_s
                )
            self.telemetry.observe("trainingd_memory_snapshot_seconds", self._snapshot_cost_s)
            # The fence wait of the snapshot is not the step's own time.
            step_s -= self._snapshot_cost_s
            self._snapshot_step, self._snapshot_cost_s = None, 0.0
            self._snapshot_staging_s, self._snapshot_allocated = 0.0, False
        self._last_step_s = max(step_s, 0.0)
        self.telemetry.set("trainingd_memory_every_steps", self.cadence.interval)

    @staticmethod
    def _tolerate_memory_failure(call: Callable[[], _T]) -> _T:
        """Run a checkpoint call; a failed memory snapshot reported by it is logged, not raised.

        The manager raises `MemorySnapshotError` once, from the first call after the failed
        copy, before doing that call's own work, so the call runs again. The older snapshot is
        intact and the tier goes on ([Note: the memory tier in the loop]).
        """
        from ckpt_manager import MemorySnapshotError

        for _ in range(_MEMORY_FAILURE_RETRIES):
            try:
                return call()
            except MemorySnapshotError as err:
                log.error("memory_snapshot_failed_training_continues", error=str(err))
        return call()

    # --- after the last step ------------------------------------------------------------------
    def drain(self) -> None:
        """Every save in flight must commit before the process exits."""
        manager, step = self.manager, self.step
        self.telemetry.heartbeat(RankPhase.STOPPING if self.stopped else RankPhase.FINISHING)
        final_metrics = self.metrics(self.last_loss or 0.0)
        if self.saved_step != step:
            self.failures.guard(
                functools.partial(manager.save, step, self.state(), metrics=final_metrics)
            )
        self.failures.guard(
            functools.partial(self._tolerate_memory_failure, manager.wait_until_finished)
        )
        if step != self.start_step and manager.stats().last_committed_step != step:
            # The final save failed (tolerated above like any other): try once more, and fail
            # the run if that fails too, rather than exit 0 with the last steps unsaved.
            manager.save(step, self.state(), metrics=final_metrics)
            manager.wait_until_finished()
        manager.check_for_errors()
        self.telemetry.update_checkpoints(manager.stats())
        self.telemetry.heartbeat(RankPhase.FINISHED)


def _sample(model: Any, job: JobSpec, rank: int) -> str | None:
    """Gather the full weights (every rank) and run the job's sample hook on rank 0.

    The checkpoints are committed by now: a hook that fails is logged and shows nothing, the
    run still counts as finished.
    """
    assert job.sample is not None
    weights = model.full_state_dict()
    if rank != 0:
        return None
    t0 = time.perf_counter()
    try:
        text = job.sample(weights)
    except Exception:
        log.exception("sample_failed")
        return None
    log.info("sample_generated", seconds=round(time.perf_counter() - t0, 3), chars=len(text))
    return text
