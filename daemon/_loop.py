"""The training loop of one rank: data -> forward/backward -> step -> metrics -> checkpoint.

Composes the two engines exactly as CONTRACTS.md describes: `sharding` wraps the model and owns
the optimizer; `ckpt_manager` receives plain state dicts. The state saved at a step is

    {"model": model.sharded_state_dict(),          # ShardedTensor leaves: each rank its piece
     "optimizer": optimizer.sharded_state_dict(),
     "scheduler": scheduler.state_dict(),          # plain JSON values, replicated
     "data": loader.state_dict(),                  # global position, identical on every rank
     "rng": RankLocal({"torch": ..., "python": ...})}   # per rank

and a restore puts back every piece, so a resumed run is bitwise the run that was not stopped
(CPU, fp32): same weights, optimizer moments, LR, data order and RNG streams.

[Note: one all-reduce per step agrees on stop and checkpoint]
After the optimizer step each rank all-reduces `[loss, stop, checkpoint]` (sum). The loss becomes
the global mean; a stop or checkpoint request seen by any rank is seen by all at the same step,
which the collective `save()` requires. One tiny collective per step is the whole cost.

[Note: one host read per step] Reading a device tensor on the host (`float(loss)`, `.item()`)
blocks until the GPU has caught up, so the host cannot queue the next kernels ahead of it. The
micro-batch losses are summed on the device; the agreed `[loss, stop, checkpoint]` and the
gradient norm come back together in one `.tolist()` after the all-reduce, the step's only
read (the stop decision needs it every step). `tests/daemon/test_loop_host_syncs.py` counts.

Checkpoint calls go through `SaveFailurePolicy` (`_save_failures.py`): a failed save is
reported and training continues, until `max_consecutive_save_failures` in a row stop the run.
The final save of the drain is retried once and must commit, else the run fails.

On CUDA (`device`, see `daemon/_device.py`) the model lives on the rank's GPU before the engine
wraps it, batches come from pinned host memory and are copied with `non_blocking=True` (the
copy overlaps the host's work on the next micro-batch), and the per-step agreement tensor lives
on the device, as NCCL requires. The CUDA RNG state is saved with the CPU one.

A run that reached `max_steps` ends with the job's `sample` (if it has one): every rank takes
part in gathering the full weights (`full_state_dict`, collective), rank 0 calls the hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import time
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from daemon._control import RankControl
from daemon._init_from import (
    InitSource,
    check_source,
    expected_tensors,
    load_into,
    storage_options_for,
)
from daemon._save_failures import SaveFailurePolicy
from daemon._telemetry import NullTelemetry, RankTelemetry
from daemon._throughput import gpu_memory, mfu_ratio, peak_flops
from daemon.config import DaemonConfig
from daemon.data import ShardedLoader
from daemon.job import JobSpec

if TYPE_CHECKING:
    from sharding import DistributedOptimizer, FullyShardedDataParallel

__all__ = ["LoopResult", "make_optimizer", "run_training"]

log = structlog.get_logger("trainingd.loop")


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


def _checkpoint_config(cfg: DaemonConfig) -> Any:
    from ckpt_manager import AsyncMode, CheckpointConfig, S3Options
    from daemon._preflight import s3_storage_options

    ck = cfg.checkpoint
    options = s3_storage_options(cfg)
    return CheckpointConfig(
        async_mode=AsyncMode(ck.async_mode.value),
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


def _materialize_optimizer_state(
    model: Any, optimizer: Any, job: JobSpec, device: torch.device
) -> None:
    """Give the optimizer its state tensors so a restore template has places for them.

    [Note: the restore template needs optimizer state] `restore(into=template)` fills only the
    leaves the template has, and a torch optimizer creates its state (AdamW: step, exp_avg,
    exp_avg_sq) lazily at the first step: a template taken before any step would silently
    restore no optimizer state. One step on zero gradients (the loss times 0, on the dataset's
    first samples) creates every state tensor; the restore then overwrites all of it, weights
    and param groups included, so nothing of this step survives.
    """
    samples = [job.train_data[i] for i in range(min(2, len(job.train_data)))]
    inputs = torch.stack([x for x, _ in samples]).to(device)
    targets = torch.stack([y for _, y in samples]).to(device)
    loss = job.loss_fn(model(inputs), targets) * 0.0
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()


def _init_source(cfg: DaemonConfig, job: JobSpec, expected: dict[str, Any]) -> InitSource | None:
    """The checked `--init-from` / `JobSpec.init_from` source, or None (see `_init_from.py`)."""
    uri = cfg.train.init_from or job.init_from
    if not uri:
        return None
    options = storage_options_for(uri, cfg.checkpoint.s3_endpoint_url)
    return check_source(expected, uri, job.init_key_map, options)


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
    from ckpt_manager import CheckpointManager, RankLocal
    from sharding import (
        DeferredInit,
        FullyShardedDataParallel,
        MixedPrecisionPolicy,
        ShardingConfig,
        Strategy,
    )

    tc = cfg.train
    rank, world = dist.get_rank(), dist.get_world_size()
    # Elastic jobs keep the global batch at any world size ([Note: an elastic job keeps its
    # global batch] in `daemon/config.py`); fixed ones accumulate `micro_batches`.
    micro_batches = cfg.micro_batches_at(world)
    device = torch.device("cpu") if device is None else device
    on_cuda = device.type == "cuda"

    # --- build: sharded model, optimizer, schedule, loader, checkpoint manager ------------------
    # `--init-from` weights are checked against the unsharded model's tensors, taken here.
    init_expected = expected_tensors(job.model) if cfg.train.init_from or job.init_from else {}
    precision = MixedPrecisionPolicy(
        param_dtype=getattr(torch, tc.param_dtype.value),
        reduce_dtype=getattr(torch, tc.reduce_dtype.value),
        output_dtype=torch.float32,  # the job's loss sees fp32 logits
    )
    # A meta-device model is materialized by the engine, unit by unit, on `device`.
    on_meta = any(p.is_meta for p in job.model.parameters())
    model = FullyShardedDataParallel(
        job.model if on_meta else job.model.to(device),
        ShardingConfig(
            strategy=Strategy(tc.strategy.engine_strategy),
            # [Note: hybrid by default across nodes] in `daemon/config.py`.
            shard_group_size=cfg.shard_group_size_at(world),
            unit_modules=job.unit_modules,
            max_inflight_reductions=tc.max_inflight_reductions,
            mixed_precision=precision,
            deferred_init=DeferredInit(seed=tc.seed, init_fn=job.init_fn),
        ),
        device=device,
        observer=telemetry,
    )
    optimizer = make_optimizer(model, lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, _lr_lambda(cfg))
    loader = ShardedLoader(
        job.train_data,
        batch_size=tc.batch_size,
        rank=rank,
        world_size=world,
        seed=tc.seed,
        pin_memory=on_cuda,
    )
    manager = CheckpointManager(
        cfg.checkpoint.ckpt_uri, _checkpoint_config(cfg), run_id=cfg.run_id, observer=telemetry
    )

    def state() -> dict[str, Any]:
        return {
            "model": model.sharded_state_dict(),
            "optimizer": optimizer.sharded_state_dict(),
            "scheduler": scheduler.state_dict(),
            "data": loader.state_dict(),
            "rng": RankLocal(_rng_state(device)),
        }

    with manager:
        # --- restore the latest committed checkpoint ------------------------------------------
        telemetry.heartbeat("restoring")
        t0 = time.perf_counter()
        if _checkpoint_exists(manager):
            _materialize_optimizer_state(model, optimizer, job, device)
        # [Note: ranks beat while restoring] Every read from storage beats the heartbeat
        # behind /healthz (published at most every `publish_interval_s`), so a restore of any
        # length stays healthy while bytes arrive, and one stuck in a read goes stale after
        # `heartbeat_timeout_s`; the supervisor extends systemd's start timeout on the same beats.
        restored = manager.restore(
            step=None, into=state(), on_progress=lambda _progress: telemetry.heartbeat()
        )
        step = 0
        if restored is not None:
            step = restored.step
            model.load_sharded_state_dict(restored.state["model"])
            optimizer.load_sharded_state_dict(restored.state["optimizer"])
            scheduler.load_state_dict(restored.state["scheduler"])
            loader.load_state_dict(restored.state["data"])
            rng = restored.state["rng"]
            rng = rng.value if isinstance(rng, RankLocal) else rng
            if rng is not None:
                _set_rng_state(rng, device)
            log.info("restored", ckpt_step=step, seconds=round(time.perf_counter() - t0, 3))
            telemetry.observe("trainingd_ckpt_restore_seconds", time.perf_counter() - t0)
        elif (init := _init_source(cfg, job, init_expected)) is not None:
            init_bytes = load_into(model, init)
            log.info("initialized_from", uri=init.source.uri, num_bytes=init_bytes)
        start_step, saved_step, last_loss, stopped = step, step, None, False
        num_tokens = 0
        failures = SaveFailurePolicy(manager, cfg.checkpoint.max_consecutive_save_failures)
        telemetry.set("trainingd_ckpt_consecutive_save_failures", failures.consecutive)
        tokens_per_step = tc.batch_size * micro_batches * job.tokens_per_sample
        # [Note: MFU] in `daemon/_throughput.py`: None (no peak known) exports no MFU.
        peak = peak_flops(device, tc.peak_flops) if job.flops_per_token > 0 else None
        telemetry.set("trainingd_train_step", step)
        telemetry.heartbeat("training")
        log.info(
            "training",
            start_step=step,
            max_steps=tc.max_steps,
            world_size=world,
            shard_group_size=model.shard_group_size,
            micro_batches=micro_batches,
        )
        # A stop requested before the first step (e.g. during a restart of the group while the
        # node drains) ends the run here, at the restored step, without training further.
        early = torch.tensor([float(control.stop_requested())], device=device)
        dist.all_reduce(early)
        stopped = bool(early[0] > 0)
        if stopped:
            log.info("stopping", step=step, signal=control.stop_signal)

        while step < tc.max_steps and not stopped:
            step_start = time.perf_counter()
            # --- data ---------------------------------------------------------------------------
            batches = [
                tuple(t.to(device, non_blocking=True) for t in loader.next_batch())
                for _ in range(micro_batches)
            ]
            data_s = time.perf_counter() - step_start
            # --- forward / backward (gradients reduced on the last micro-batch) -----------------
            loss_sum = torch.zeros((), device=device)
            for i, (inputs, targets) in enumerate(batches):
                last = i == len(batches) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = job.loss_fn(model(inputs), targets) / len(batches)
                    loss.backward()  # type: ignore[no-untyped-call]
                loss_sum += loss.detach()
            # --- step ---------------------------------------------------------------------------
            grad_norm = optimizer.clip_grad_norm_(tc.grad_clip if tc.grad_clip > 0 else math.inf)
            lr = float(scheduler.get_last_lr()[0])
            manager.before_optimizer_step()  # an async save's snapshot copy must be done
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            # --- agree on loss, stop and checkpoint requests (see the Note above) ---------------
            stop_local, ckpt_local = control.poll()
            # [Note: one host read per step]; a pageable host->device copy with non_blocking
            # is staged at once, without waiting for the stream (a blocking one would).
            flags = torch.tensor([float(stop_local), float(ckpt_local)])
            agreed = torch.cat([loss_sum.float().reshape(1), flags.to(device, non_blocking=True)])
            dist.all_reduce(agreed)
            loss_total, stop_count, ckpt_count, grad_norm_value = torch.cat(
                [agreed, grad_norm.float().reshape(1)]
            ).tolist()
            last_loss = loss_total / world
            stopped, ckpt_requested = stop_count > 0, ckpt_count > 0
            step_s = time.perf_counter() - step_start
            # --- metrics ------------------------------------------------------------------------
            telemetry.inc("trainingd_train_steps_total")
            telemetry.set("trainingd_train_step", step)
            telemetry.observe("trainingd_train_step_duration_seconds", step_s)
            telemetry.observe("trainingd_train_data_loading_seconds", data_s)
            step_tokens = tokens_per_step or sum(int(b[0].numel()) for b in batches)
            num_tokens += step_tokens
            telemetry.inc("trainingd_train_tokens_total", step_tokens)
            telemetry.set("trainingd_train_tokens_per_second", step_tokens / step_s)
            if peak is not None:
                mfu = mfu_ratio(step_tokens / step_s, job.flops_per_token, peak)
                telemetry.set("trainingd_train_mfu_ratio", mfu)
            for name, num_bytes in gpu_memory(device).items():
                telemetry.set(name, num_bytes)
            telemetry.set("trainingd_train_loss", last_loss)
            telemetry.set("trainingd_train_grad_norm", grad_norm_value)
            telemetry.set("trainingd_train_learning_rate", lr)
            if step == start_step + 1:
                recovery = time.time() - telemetry.started_unix_s
                telemetry.set("trainingd_rank_recovery_seconds", recovery)
            telemetry.update_sharding(model.stats.snapshot())
            # --- checkpoint ---------------------------------------------------------------------
            every = cfg.checkpoint.ckpt_every
            if (every and step % every == 0) or ckpt_requested or stopped or step == tc.max_steps:
                failures.guard(
                    functools.partial(manager.save, step, state(), metrics={"loss": last_loss})
                )
                saved_step = step
                log.info("checkpoint_scheduled", ckpt_step=step, loss=round(last_loss, 4))
            failures.guard(manager.maybe_finalize)
            telemetry.update_checkpoints(manager.stats())
            telemetry.set("trainingd_ckpt_consecutive_save_failures", failures.consecutive)
            telemetry.heartbeat()
            if rank == 0 and (step % 10 == 0 or step == tc.max_steps):
                log.info(
                    "step", step=step, loss=round(last_loss, 4), lr=lr, step_s=round(step_s, 4)
                )
            if stopped:
                log.info("stopping", step=step, signal=control.stop_signal)
                break

        # --- drain: every save in flight must commit before the process exits -----------------
        telemetry.heartbeat("stopping" if stopped else "finishing")
        final_metrics = {"loss": last_loss or 0.0}
        if saved_step != step:
            failures.guard(functools.partial(manager.save, step, state(), metrics=final_metrics))
        failures.guard(manager.wait_until_finished)
        if step != start_step and manager.stats().last_committed_step != step:
            # The final save failed (tolerated above like any other): try once more, and fail
            # the run if that fails too, rather than exit 0 with the last steps unsaved.
            manager.save(step, state(), metrics=final_metrics)
            manager.wait_until_finished()
        manager.check_for_errors()
        telemetry.update_checkpoints(manager.stats())
        telemetry.heartbeat("finished")
    # --- the job's sample of the trained model (a completed run only) ------------------------
    sample = None
    if not stopped and job.sample is not None:
        sample = _sample(model, job, rank)
    return LoopResult(
        start_step=start_step,
        final_step=step,
        stopped=stopped,
        last_loss=last_loss,
        num_tokens=num_tokens,
        sample=sample,
    )


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
