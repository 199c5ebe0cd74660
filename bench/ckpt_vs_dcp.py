"""Benchmark: our checkpoint manager vs torch DCP at its best, raw writes and plain s3fs.

One invocation, 2 gloo ranks, each training its own GPT replica (`daemon.jobs.gpt`, AdamW) sized so
that parameters plus optimizer state are at least `--size-mib` per rank (default 512 MiB).
Every rank's state is distinct: DCP gets rank-tagged keys (it silently deduplicates equal
keys), our manager gets each tensor as that rank's shard of a `(world, ...)` tensor.

Three fresh sets of ranks run, one after the other, so that peers never share memory or
background processes: the baselines (one memcpy of the state, a raw sequential write + fsync
of the same bytes, blocking `dcp.save`, DCP `async_save` in its default THREAD mode, DCP at its
best, a bare background memcpy, plain s3fs `pipe_file` to SeaweedFS), ours (`ckpt_manager`),
and ours again with ONE training rank on the machine (a spare core: the regime of a GPU node),
once the S3 server has stopped.

DCP at its best is configured as its async recipe shows: `AsyncCheckpointerType.PROCESS` (the
save runs in a checkpoint process), one `DefaultStager(StagingOptions(use_async_staging=True,
use_shared_memory=True, ...))` reused across saves (staging into shared memory on a
background thread, overlapping forward/backward), and the loop waits on
`staging_completion` before `optimizer.step()`. Per peer, per round:

- stall per save: wall time the loop is blocked by checkpointing: inside `save()` plus the
  fence before the optimizer step (ours, DCP best); the return time of `async_save` (DCP
  default, whose staging copy is blocking);
- inflation per save: windows of `--every` training steps, one save at the start of every
  other window, in `--rounds` (no save, one save) pairs run in ABBA order; a saving window
  ends by waiting for its save to finish (inside the timing), so everything the save costs
  the loop lands in its window; inflation = saving window - plain window (and, as the
  diagnostic `inflation_stepwise_s`, the sum over a window's steps of the median step time
  with a save minus without, which a host that delays single steps moves less);
- extra CPU seconds per save in the loop: the rank process and every process below it (our
  writer, DCP's checkpoint process), saving window - plain window; with training using every
  core, CPU spent on checkpointing is what inflates the loop;
- CPU of a whole save, idle loop (ours: rank + writer), in memcpys of the state;
- local throughput: state bytes of all ranks / wall time from save to durable, idle loop; vs
  all ranks writing the same bytes to one file each with fsync, same directory;
- S3 throughput: ours against SeaweedFS on loopback vs plain s3fs `pipe_file`.

- fixed CPU per save (`save_fixed_cpu_s`, issue 33): what a save costs beyond copy,
  checksum and write: whole saves (rank + writer CPU, idle loop) of the same tree of tensors
  with one element per tensor per rank, in batches (the writer's CPU comes in 10 ms ticks).

Each key is reported as its median with a bootstrap 95% interval (`ci95_lo`, `ci95_hi`;
`bench/_stats.py`) and min-max over rounds (ratios: `_ratio_spread`, each side resampled on
its own, as the peers run in separate ranks; min-max bounds every pairing of their rounds).
A verdict (`verdicts`) holds only when the interval's bad end meets the target; `misses`
when even its good end does not, `inconclusive` when it straddles the target. The two
inflation keys are differences of wall-clock windows: each has an A/A key (`<key>_a_a`, the
same estimator on consecutive save-free windows), and when that noise floor is not below a
quarter of the target the key is null with the reason in `unresolved` ("unresolved on this
machine"). `memcpy_gib_s` is the rate of the memcpy unit (the fastest of several before
the run); `save_cpu_vs_memcpy_paired` divides each idle save's CPU by a memcpy of the state
timed right after it instead (`memcpy_paired_s`: those memcpys), a diagnostic for machines
whose memory speed moves under load. One untimed pair precedes each
peer's rounds (DCP caches its plan and starts its process; ours allocates staging memory).
Targets (issues 20 and 33): stall and inflation <= 0.25x DCP at its best, whole-save CPU <=
2.0 memcpys, fixed CPU per save <= 0.25 memcpy, spare-core inflation <= 0.5 memcpy, local >=
0.9x raw, S3 >= 0.9x s3fs.

    .venv/bin/python bench/ckpt_vs_dcp.py --json                       # 512 MiB/rank, 8 rounds
    .venv/bin/python bench/ckpt_vs_dcp.py --size-mib 64 --rounds 2     # quick run
    .venv/bin/python bench/ckpt_vs_dcp.py --smoke --json               # end-to-end check
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib
import itertools
import math
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common
import _stats
from _common import MIB, median

LAYERS = 4


@dataclasses.dataclass(frozen=True)
class _Shard:
    """This rank's piece of a `(world, *shape)` tensor, in the contract's flat form."""

    local: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    flat_range: tuple[int, int] | None


def _width_for(size_mib: int) -> int:
    """Smallest d_model (multiple of 64) whose GPT params + AdamW moments reach `size_mib`."""
    # 4 blocks of 12 d^2 weights; params, exp_avg and exp_avg_sq are fp32 (12 bytes/param).
    d = math.sqrt(size_mib * MIB / 12 / (12 * LAYERS))
    return max(64, math.ceil(d / 64) * 64)


class _Trainer:
    """One rank's replica: GPT + AdamW on its own random bytes."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        import torch

        from daemon import GPT, GPTConfig

        d_model = _width_for(spec["size_mib"])
        self.cfg = GPTConfig(
            seq_len=spec["seq_len"],
            num_layers=LAYERS,
            num_heads=d_model // 64,
            d_model=d_model,
            tie_embeddings=True,
        )
        torch.manual_seed(spec["seed"] + rank)
        self.model = GPT(self.cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
        self.batches = torch.randint(
            0, self.cfg.vocab_size, (8, spec["batch"], self.cfg.seq_len + 1), generator=gen
        )
        self.num_steps = 0
        self.step_group: Any = None
        # One step creates the optimizer state, so the state has its final tensors.
        self.forward_backward()
        self.optimizer_step()

    def forward_backward(self) -> float:
        import torch.distributed as dist

        from daemon import lm_loss

        b = self.batches[self.num_steps % len(self.batches)]
        loss = lm_loss(self.model(b[:, :-1]), b[:, 1:])
        loss.backward()
        # Data-parallel training synchronises every step (gradient all-reduce); the replicas
        # here are independent, so a scalar all-reduce stands in for it. Without it ranks
        # drift apart, and the first collective of a save (ours agrees in maybe_finalize)
        # would charge one rank for waiting on the other.
        # Its own group: DCP's async_save runs collectives on the default group from its
        # background thread, and two threads sharing one group would interleave.
        if self.step_group is None:
            self.step_group = dist.new_group(backend="gloo")
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=self.step_group)
        return float(mean_loss) / dist.get_world_size()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.num_steps += 1

    def named_tensors(self) -> list[tuple[str, Any]]:
        """Every tensor of the checkpointed state (live: training mutates them in place)."""
        out = [(f"model.{n}", p.detach()) for n, p in self.model.named_parameters()]
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                out.append((f"optim.{names[id(p)]}.{key}", st[key]))
        return out

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    def dcp_state(self, rank: int) -> dict[str, Any]:
        """Rank-tagged keys: DCP deduplicates tensors saved under the same key."""
        return {f"rank{rank}.{n}": t for n, t in self.named_tensors()}

    def manager_state(self, rank: int, world_size: int) -> dict[str, Any]:
        """Each tensor as this rank's shard of a `(world, *shape)` whole, plus the step."""
        tensors = {}
        for n, t in self.named_tensors():
            numel = t.numel()
            tensors[n] = _Shard(
                local=t.view(-1),
                global_shape=(world_size, *t.shape),
                global_offset=(0,) * (t.dim() + 1),
                flat_range=(rank * numel, (rank + 1) * numel),
            )
        return {"tensors": tensors, "step": self.num_steps}


def _byte_views(tensors: list[Any]) -> Iterator[memoryview]:
    """Zero-copy byte views of contiguous CPU tensors."""
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            yield memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _timed_all(fn: Any) -> float:
    """Run `fn` on every rank from a barrier; the slowest rank's wall time."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _rank0_rmtree(rank: int, path: Path) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


# ---------------------------------------------------------------- baselines


def _memcpy_s(trainer: _Trainer, repeats: int) -> tuple[float, float]:
    """One memcpy of the state: (CPU seconds of this thread, wall seconds), fastest of many.

    The CPU figure is the unit of every ratio in memcpys: a memcpy is fixed work, and its CPU
    time is what other load on a shared machine moves least (wall time picks up the time
    slices lost to other processes: 4x at load average 20). The wall figure is reported.
    """
    import torch

    tensors = [t for _, t in trainer.named_tensors()]
    dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors, strict=True):  # first touch outside the timing
        d.copy_(t)
    cpu, wall = [], []
    for _ in range(max(5, repeats)):
        c0, t0 = time.thread_time(), time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return min(cpu), min(wall)


def _raw_write(trainer: _Trainer, path: Path) -> None:
    """Sequential write of the state's bytes, then fsync (the disk's honest speed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in _byte_views([t for _, t in trainer.named_tensors()]):
            for off in range(0, len(view), 16 * MIB):
                chunk = view[off : off + 16 * MIB]
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of this process, or of `pid`."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime are fields 14 and 15 (1-based) of the whole line; [0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendant_pids(pid: int) -> list[int]:
    """Every live process below `pid` (our writer, DCP's checkpoint process, their helpers)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:  # the thread or process ended meanwhile
            continue
        for child in children:
            out.append(child)
            out.extend(_descendant_pids(child))
    return out


def _tree_cpu_s() -> float:
    """CPU seconds of this process, its live descendants and its reaped children.

    A checkpointer's background process (our writer, DCP's PROCESS-mode saver) burns CPU the
    loop pays for on a busy machine, so every peer is charged for its whole process tree.
    """
    total = _cpu_s() + _reaped_children_cpu_s()
    for pid in _descendant_pids(os.getpid()):
        with contextlib.suppress(OSError, IndexError, ValueError):  # it exited meanwhile
            total += _cpu_s(pid)
    return total


def _reaped_children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _window(
    trainer: _Trainer,
    steps: int,
    save: Any = None,
    before_optimizer: Any = None,
    after_optimizer: Any = None,
    drain: Any = None,
) -> dict[str, float]:
    """`steps` training steps; with `save`, one save after the first optimizer step.

    `before_optimizer()` and `after_optimizer()` run around every optimizer step (our fence,
    our `maybe_finalize()`); `drain()` runs at the end, inside the timing, so a save still
    writing when the window ends is paid for here.
    CPU seconds are those of this process and every process below it (`_tree_cpu_s`).
    """
    cpu0 = _tree_cpu_s()
    t0 = time.perf_counter()
    hooks_s = 0.0  # time inside the checkpointing calls (where the loop waits, if anywhere)
    steps_s: list[float] = []  # each step's wall time, hooks and the save included
    for i in range(steps):
        t_step = time.perf_counter()
        trainer.forward_backward()
        t1 = time.perf_counter()
        if before_optimizer is not None:
            before_optimizer()
        t2 = time.perf_counter()
        trainer.optimizer_step()
        t3 = time.perf_counter()
        if after_optimizer is not None:
            after_optimizer()
        if save is not None and i == 0:
            save()
        t_end = time.perf_counter()
        hooks_s += (t2 - t1) + (t_end - t3)
        steps_s.append(t_end - t_step)
    t4 = time.perf_counter()
    if drain is not None:
        drain()
    end = time.perf_counter()
    return {
        "loop_s": end - t0,
        "cpu_s": _tree_cpu_s() - cpu0,
        "hooks_s": hooks_s,
        "drain_s": end - t4,
        "steps_s": steps_s,
    }


def _window_pairs(pairs: int, plain: Any, saving: Any) -> dict[str, list[dict[str, float]]]:
    """`pairs` (window without saves, window with one save), in ABBA order.

    Adjacent windows see the same machine, and alternating which comes first cancels a
    linear drift (warm-up, other load) that a fixed order would book as save cost. One
    untimed pair runs first.
    """
    plain()
    saving()
    out: dict[str, list[dict[str, float]]] = {"none": [], "saving": []}
    for p in range(pairs):
        order = (("none", plain), ("saving", saving))
        for kind, fn in order if p % 2 == 0 else order[::-1]:
            out[kind].append(fn())
    return out


def _copy_windows(trainer: _Trainer, spec: dict[str, Any]) -> dict[str, Any]:
    """The cheapest possible asynchronous snapshot: one background-thread memcpy of the state
    into preallocated memory, fenced before the next optimizer step; nothing written.

    Its inflation is what one memcpy costs a loop that already uses every core (the copy
    competes for CPU and memory bandwidth), the floor under any async checkpointer's.
    """
    import threading

    import torch

    tensors = [t for _, t in trainer.named_tensors()]
    dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors, strict=True):  # first touch outside the timing
        d.copy_(t)
    pending: list[threading.Thread] = []

    def copy_all() -> None:
        with torch.no_grad():
            for d, t in zip(dst, tensors, strict=True):
                d.copy_(t)

    def save() -> None:
        thread = threading.Thread(target=copy_all, name="bg-copy")
        thread.start()
        pending.append(thread)

    def fence() -> None:
        while pending:
            pending.pop().join()

    return _window_pairs(
        spec["pairs"],
        lambda: _window(trainer, spec["every"], before_optimizer=fence),
        lambda: _window(trainer, spec["every"], save=save, before_optimizer=fence),
    )


def _dcp_windows(trainer: _Trainer, rank: int, spec: dict[str, Any], root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = trainer.dcp_state(rank)
    returns: list[float] = []
    future: list[Any] = []

    def save() -> None:
        t0 = time.perf_counter()
        future.append(dcp.async_save(state, checkpoint_id=str(root / f"step-{trainer.num_steps}")))
        returns.append(time.perf_counter() - t0)

    def drain() -> None:
        future.pop().result(timeout=600)

    def saving() -> dict[str, float]:
        # DCP's writes run on a thread of this process: its CPU is this process's.
        result = _window(trainer, spec["every"], save=save, drain=drain)
        _rank0_rmtree(rank, root)
        return result

    windows: dict[str, Any] = _window_pairs(
        spec["pairs"], lambda: _window(trainer, spec["every"]), saving
    )
    # The first (untimed) pair's save is the one that builds DCP's cached plan.
    windows["return_s"] = returns[1:]
    return windows


def _dcp_best_stager() -> Any:
    """DCP's `DefaultStager` as its async recipe configures it for this machine.

    Asynchronous staging on a background thread into shared memory (handed to the PROCESS
    saver without a copy); pinned memory and non-blocking copies only with an accelerator
    (DCP refuses non-blocking copies without one, and pinning CPU tensors buys nothing).
    Created once and reused across saves: it caches its staging storages.
    """
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    accelerated = torch.accelerator.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=accelerated,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=accelerated,
        )
    )


def _dcp_best_save(state: dict[str, Any], path: Path, stager: Any) -> Any:
    """One `async_save` of DCP at its best: PROCESS saver, the reused async stager."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return dcp.async_save(
        state,
        checkpoint_id=str(path),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=stager,
    )


def _dcp_best_windows(
    trainer: _Trainer, rank: int, spec: dict[str, Any], root: Path, stager: Any
) -> dict[str, Any]:
    """DCP at its best in the loop: `async_save` returns once staging is queued; the loop
    waits on `staging_completion` before the next `optimizer.step()` (the recipe's fence);
    the window ends waiting on `upload_completion`. Stall = return time + fence wait."""
    state = trainer.dcp_state(rank)
    stalls: list[float] = []
    pending: list[Any] = []
    unfenced: list[Any] = []

    def save() -> None:
        t0 = time.perf_counter()
        response = _dcp_best_save(state, root / f"step-{trainer.num_steps}", stager)
        stalls.append(time.perf_counter() - t0)
        pending.append(response)
        unfenced.append(response)

    def fence() -> None:
        while unfenced:
            t0 = time.perf_counter()
            unfenced.pop().staging_completion.result(timeout=600)
            stalls[-1] += time.perf_counter() - t0

    def drain() -> None:
        fence()
        while pending:
            pending.pop().upload_completion.result(timeout=600)

    def saving() -> dict[str, float]:
        result = _window(trainer, spec["every"], save=save, before_optimizer=fence, drain=drain)
        _rank0_rmtree(rank, root)
        return result

    windows: dict[str, Any] = _window_pairs(
        spec["pairs"], lambda: _window(trainer, spec["every"], before_optimizer=fence), saving
    )
    # The first (untimed) pair's save starts DCP's checkpoint process and sizes its staging.
    windows["stall_s"] = stalls[1:]
    return windows


def _dcp_best_idle(
    trainer: _Trainer, rank: int, spec: dict[str, Any], root: Path, stager: Any
) -> list[float]:
    """DCP at its best, `async_save` to upload complete with nothing else running."""
    state = trainer.dcp_state(rank)
    times = []
    for i in range(spec["repeats"]):
        path = root / f"idle-{i}"
        times.append(
            _timed_all(lambda p=path: _dcp_best_save(state, p, stager).upload_completion.result())
        )
        _rank0_rmtree(rank, path)
    return times


def _baselines(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    _common.stdout_to_stderr()
    trainer = _Trainer(spec, rank)
    root = Path(spec["dir"]) / "baselines"
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"state_bytes": trainer.num_bytes(), "d_model": trainer.cfg.d_model}

    out["memcpy_s"], out["memcpy_wall_s"] = _memcpy_s(trainer, spec["repeats"])

    raw: list[float] = []
    for i in range(spec["repeats"]):
        raw.append(_timed_all(lambda i=i: _raw_write(trainer, root / f"raw-{i}-rank{rank}.bin")))
        (root / f"raw-{i}-rank{rank}.bin").unlink()
    out["raw_write_s"] = raw

    dcp_state = trainer.dcp_state(rank)
    blocking: list[float] = []
    for i in range(spec["repeats"]):
        path = root / f"dcp-blocking-{i}"
        blocking.append(_timed_all(lambda p=path: dcp.save(dcp_state, checkpoint_id=str(p))))
        _rank0_rmtree(rank, path)
    out["dcp_save_s"] = blocking

    # One untimed async save first: DCP caches its save plan after the first call.
    t0 = time.perf_counter()
    dcp.async_save(dcp_state, checkpoint_id=str(root / "dcp-warmup")).result(timeout=600)
    out["dcp_first_async_save_s"] = time.perf_counter() - t0
    _rank0_rmtree(rank, root / "dcp-warmup")

    out["windows"] = _dcp_windows(trainer, rank, spec, root / "dcp")
    # DCP's PROCESS saver is a multiprocessing child, which a daemonic process may not start,
    # and the harness's ranks are daemonic (so that they die with the bench). Lifted for this
    # rank only: it reaps its children on exit, and DCP's saver process is itself a daemon.
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    stager = _dcp_best_stager()
    try:
        out["dcp_best_windows"] = _dcp_best_windows(trainer, rank, spec, root / "dcp-best", stager)
        out["dcp_best_save_s"] = _dcp_best_idle(trainer, rank, spec, root / "dcp-best", stager)
    finally:
        stager.close()
    out["copy_windows"] = _copy_windows(trainer, spec)

    if spec["s3"] is not None:
        out["s3fs_pipe_s"] = _s3fs_pipe(trainer, rank, spec)
    return out


def _s3fs_pipe(trainer: _Trainer, rank: int, spec: dict[str, Any]) -> list[float]:
    import s3fs

    s3 = spec["s3"]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3["storage_options"])
    blob = b"".join(_byte_views([t for _, t in trainer.named_tensors()]))
    times: list[float] = []
    for i in range(spec["s3_repeats"]):
        path = f"{s3['bucket']}/s3fs/{i}/rank{rank}.bin"
        times.append(_timed_all(lambda p=path: fs.pipe_file(p, blob)))
        fs.rm_file(path)
    return times


# ---------------------------------------------------------------- ours


class _Reports:
    """A `SaveObserver` keeping every report."""

    def __init__(self) -> None:
        self.reports: list[Any] = []

    def on_save_finished(self, report: Any) -> None:
        self.reports.append(report)


def _our_windows(
    trainer: _Trainer, mgr: Any, rank: int, world_size: int, spec: dict[str, Any]
) -> dict[str, Any]:
    state = trainer.manager_state(rank, world_size)
    stalls: list[float] = []

    def save() -> None:
        state["step"] = trainer.num_steps
        t0 = time.perf_counter()
        mgr.save(trainer.num_steps, state)
        stalls.append(time.perf_counter() - t0)

    def fence() -> None:
        # The training loop's part of a save: the wait before parameters change.
        t0 = time.perf_counter()
        mgr.before_optimizer_step()
        if stalls:
            stalls[-1] += time.perf_counter() - t0

    def window(with_save: bool) -> dict[str, float]:
        return _window(
            trainer,
            spec["every"],
            save=save if with_save else None,
            before_optimizer=fence,
            after_optimizer=mgr.maybe_finalize,
            drain=lambda: _wait_committed(mgr),
        )

    windows: dict[str, Any] = _window_pairs(
        spec["pairs"], lambda: window(False), lambda: window(True)
    )
    windows["stall_s"] = stalls[1:]  # without the untimed first pair
    return windows


def _manager(root: str, spec: dict[str, Any], storage_options: dict[str, Any]) -> Any:
    from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast

    config = CheckpointConfig(
        async_mode=AsyncMode(spec["async_mode"]),
        storage_options=storage_options,
        # Bounded disk use; deleting old steps is part of what checkpointing costs.
        retention=KeepLast(n=2),
    )
    observer = _Reports()
    return CheckpointManager(root, config, run_id="bench", observer=observer), observer


def _wait_committed(mgr: Any) -> None:
    """Finalize until nothing is in flight (what `wait_until_finished()` does, minus its wait
    for the retention deleter: deleting old steps runs in the background, costs I/O wait and
    no CPU, and a training loop never waits for it).

    `maybe_finalize()` agrees across ranks, so every rank sees the commit in the same call
    and this loop runs equally often on each.
    """
    while mgr.stats().inflight:
        mgr.maybe_finalize()
        time.sleep(0.005)


def _idle_saves(trainer: _Trainer, mgr: Any, rank: int, world_size: int, n: int) -> list[float]:
    """Save-to-committed wall time with nothing else running (end-to-end throughput)."""
    state = trainer.manager_state(rank, world_size)
    times = []
    for _ in range(n):
        trainer.num_steps += 1
        state["step"] = trainer.num_steps

        def one(step: int = trainer.num_steps) -> None:
            mgr.save(step, state)
            mgr.before_optimizer_step()
            _wait_committed(mgr)

        times.append(_timed_all(one))
        # Untimed: let retention delete the step this commit pushed out before the next
        # save starts. Saves in training are steps apart, so its unlinks (0.1-0.2 s of disk
        # work for 2 x 580 MiB) never meet the next save's writes; back to back they slow
        # them by half (0.47 s -> 0.73-0.94 s for two concurrent 580 MiB shard writes).
        mgr.wait_until_finished()
    return times


def _cpu_per_save(
    trainer: _Trainer, mgr: Any, rank: int, world_size: int, n: int
) -> list[dict[str, float]]:
    """CPU seconds of whole saves (rank process, writer process) with nothing else running.

    Unlike the windows' wall-clock difference this is fixed work, free of the loop's noise:
    everything a save costs from `save()` to committed, retention's deletion included. The
    wait is `wait_until_finished()` (one blocking agreement) rather than polling, so no
    polling is counted.

    After each save (outside its CPU window) one memcpy of the state is timed too
    (`memcpy_after_s`), every rank at once as their saves' copies ran: the unit at the memory
    speed of that moment, for `save_cpu_vs_memcpy_paired`.
    """
    import torch

    state = trainer.manager_state(rank, world_size)
    tensors = [t for _, t in trainer.named_tensors()]
    dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors, strict=True):  # first touch outside any timing
        d.copy_(t)
    out = []
    for _ in range(n):
        trainer.num_steps += 1
        state["step"] = trainer.num_steps
        pid = mgr.writer_pid  # persistent mode; a temporal writer is reaped by the commit
        rank0, children0 = _cpu_s(), _reaped_children_cpu_s()
        writer0 = _cpu_s(pid) if pid is not None else 0.0
        mgr.save(trainer.num_steps, state)
        mgr.before_optimizer_step()
        mgr.wait_until_finished()
        if mgr.writer_pid != pid:
            raise RuntimeError(f"writer changed during a save ({pid} -> {mgr.writer_pid})")
        writer = _reaped_children_cpu_s() - children0
        if pid is not None:
            writer += _cpu_s(pid) - writer0
        rank_cpu = _cpu_s() - rank0
        t0 = time.thread_time()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        memcpy_after = time.thread_time() - t0
        out.append({"rank_cpu_s": rank_cpu, "writer_cpu_s": writer, "memcpy_after_s": memcpy_after})
    return out


def _skeleton_state(trainer: _Trainer, rank: int, world_size: int) -> dict[str, Any]:
    """The bench state's tree with one element per tensor per rank: the same keys, dtypes,
    sharding and tensor count, next to no bytes (what a save costs beyond its bytes)."""
    import torch

    tensors = {
        n: _Shard(
            local=torch.zeros(1, dtype=t.dtype),
            global_shape=(world_size,),
            global_offset=(0,),
            flat_range=(rank, rank + 1),
        )
        for n, t in trainer.named_tensors()
    }
    return {"tensors": tensors, "step": trainer.num_steps}


def _fixed_cpu(
    trainer: _Trainer, mgr: Any, rank: int, world_size: int, spec: dict[str, Any]
) -> list[float]:
    """CPU seconds per save beyond copy, checksum and write: whole saves (rank process +
    writer, as `_cpu_per_save` counts them) of `_skeleton_state` on the bench's manager, in
    batches.

    The writer's CPU comes from `/proc` in 10 ms clock ticks, which a single save of a few
    milliseconds would round away: each figure is a batch of `fixed_batch` saves' CPU over
    the batch, `fixed_batches` of them. One untimed save first plans the new layout.
    """
    state = _skeleton_state(trainer, rank, world_size)

    def one() -> None:
        trainer.num_steps += 1
        state["step"] = trainer.num_steps
        mgr.save(trainer.num_steps, state)
        mgr.before_optimizer_step()
        mgr.wait_until_finished()

    one()
    pid = mgr.writer_pid
    out: list[float] = []
    for _ in range(spec["fixed_batches"]):
        rank0, children0 = _cpu_s(), _reaped_children_cpu_s()
        writer0 = _cpu_s(pid) if pid is not None else 0.0
        for _ in range(spec["fixed_batch"]):
            one()
        if mgr.writer_pid != pid:
            raise RuntimeError(f"writer changed during a batch ({pid} -> {mgr.writer_pid})")
        writer = _reaped_children_cpu_s() - children0
        if pid is not None:
            writer += _cpu_s(pid) - writer0
        out.append((_cpu_s() - rank0 + writer) / spec["fixed_batch"])
    return out


def _ours(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    _common.stdout_to_stderr()
    trainer = _Trainer(spec, rank)
    root = Path(spec["dir"]) / "ours"
    out: dict[str, Any] = {"state_bytes": trainer.num_bytes()}
    # The unit of save_cpu_vs_memcpy, measured in these ranks too (for `--only ours`).
    out["memcpy_s"], out["memcpy_wall_s"] = _memcpy_s(trainer, spec["repeats"])

    mgr, observer = _manager(str(root / "local"), spec, {})
    with mgr:
        # The first save of a run allocates and first-touches the staging memory: reported,
        # then kept out of the steady-state figures.
        out["first_save_s"] = _idle_saves(trainer, mgr, rank, world_size, 1)[0]
        out["windows"] = _our_windows(trainer, mgr, rank, world_size, spec)
        out["local_save_s"] = _idle_saves(trainer, mgr, rank, world_size, spec["repeats"])
        out["cpu_per_save"] = _cpu_per_save(trainer, mgr, rank, world_size, spec["cpu_saves"])
        num_reports = len(observer.reports)  # the state's saves; the skeleton's follow
        out["fixed_cpu_s"] = _fixed_cpu(trainer, mgr, rank, world_size, spec)
    out["local_reports"] = [r._asdict() for r in observer.reports[:num_reports]]
    _rank0_rmtree(rank, root / "local")

    if spec["s3"] is not None:
        s3 = spec["s3"]
        mgr, observer = _manager(f"s3://{s3['bucket']}/ours", spec, s3["storage_options"])
        with mgr:
            _idle_saves(trainer, mgr, rank, world_size, 1)
            out["s3_save_s"] = _idle_saves(trainer, mgr, rank, world_size, spec["s3_repeats"])
        out["s3_reports"] = [r._asdict() for r in observer.reports]
    return out


# ---------------------------------------------------------------- driver


def _manager_available() -> str | None:
    try:
        mod = importlib.import_module("ckpt_manager")
    except Exception as err:
        return f"import ckpt_manager failed: {err!r}"
    need = ("CheckpointManager", "CheckpointConfig", "AsyncMode")
    missing = [n for n in need if n not in getattr(mod, "__all__", ())]
    return f"ckpt_manager.__all__ lacks {missing}" if missing else None


@contextlib.contextmanager
def _seaweed(enabled: bool, data_dir: Path) -> Iterator[dict[str, Any] | None]:
    if not enabled:
        yield None
        return
    from tests.support.s3 import isolate_aws_environment
    from tests.support.seaweed import SeaweedS3

    isolate_aws_environment()
    with SeaweedS3(data_dir, bucket="bench") as server:
        target = server.default_target()
        yield {
            "bucket": target.bucket,
            "endpoint_url": target.endpoint_url,
            "storage_options": target.storage_options,
        }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512, help="state per rank (default 512)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--every", type=int, default=4, help="steps per window (default 4)")
    p.add_argument(
        "--rounds",
        "--pairs",
        dest="pairs",
        type=int,
        default=8,
        help="rounds: (no save, one save) window pairs per peer (default 8)",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats of each local one-shot timing")
    p.add_argument("--s3-repeats", type=int, default=2, help="repeats of each S3 timing")
    p.add_argument(
        "--cpu-saves", type=int, default=8, help="idle saves for save_cpu_vs_memcpy (default 8)"
    )
    p.add_argument(
        "--fixed-batches",
        type=int,
        default=8,
        help="batches of skeleton saves for save_fixed_cpu_s (default 8)",
    )
    p.add_argument(
        "--fixed-batch", type=int, default=5, help="skeleton saves per batch (default 5)"
    )
    p.add_argument("--async-mode", default="persistent", help="our AsyncMode (default persistent)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="local directory to write into (default: tmp)")
    p.add_argument("--no-s3", action="store_true", help="skip the SeaweedFS comparison")
    p.add_argument(
        "--no-spare-core", action="store_true", help="skip the one-rank (spare core) run"
    )
    p.add_argument("--only", choices=("baselines", "ours", "both"), default="both")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per set of ranks")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny config to check the script end to end (1 rank, 2 MiB, 1 round, no S3)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.world_size, args.size_mib, args.pairs, args.repeats = 1, 2, 1, 1
        args.every, args.no_s3 = 2, True
        args.cpu_saves, args.fixed_batches, args.fixed_batch = 2, 2, 2
    numbers = (args.size_mib, args.repeats, args.s3_repeats, args.pairs, args.cpu_saves)
    if min(*numbers, args.fixed_batches, args.fixed_batch) < 1:
        p.error(
            "--size-mib, --repeats, --s3-repeats, --rounds, --cpu-saves, --fixed-batches and "
            "--fixed-batch must be >= 1"
        )
    if args.every < 2:
        p.error("--every must be >= 2 (a save needs following steps to overlap with)")
    return args


def _spare_core(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One training rank on the whole machine (the regime of a GPU node, whose host CPU has
    room): one memcpy of its state, and ours in the loop."""
    _common.stdout_to_stderr()
    trainer = _Trainer(spec, rank)
    root = Path(spec["dir"]) / "spare-core"
    out: dict[str, Any] = {"state_bytes": trainer.num_bytes()}
    out["memcpy_s"], out["memcpy_wall_s"] = _memcpy_s(trainer, spec["repeats"])
    mgr, _ = _manager(str(root), spec, {})
    with mgr:
        _idle_saves(trainer, mgr, rank, world_size, 1)
        out["windows"] = _our_windows(trainer, mgr, rank, world_size, spec)
    _rank0_rmtree(rank, root)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table (or JSON)."""
    args = _parse_args(argv)
    skipped: dict[str, str] = {}
    run_ours = args.only in ("ours", "both")
    if run_ours and (why := _manager_available()) is not None:
        skipped["ours"] = why
        run_ours = False
    own_dir = args.dir is None
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    conditions_before = _common.machine_conditions()
    report: dict[str, Any] = {}
    try:
        with _seaweed(not args.no_s3, work / "seaweed") as s3:
            spec = {
                "size_mib": args.size_mib,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "every": args.every,
                "pairs": args.pairs,
                "repeats": args.repeats,
                "s3_repeats": args.s3_repeats,
                "cpu_saves": args.cpu_saves,
                "fixed_batches": args.fixed_batches,
                "fixed_batch": args.fixed_batch,
                "async_mode": args.async_mode,
                "seed": args.seed,
                "dir": str(work / "local"),
                "s3": s3,
            }
            base: list[dict[str, Any]] | None = None
            ours: list[dict[str, Any]] | None = None
            spare: list[dict[str, Any]] | None = None
            if args.only in ("baselines", "both"):
                _log(args, "baselines: memcpy, raw write, DCP (default and best), s3fs ...")
                base = _common.run_ranks(
                    _baselines, args.world_size, spec, timeout_s=args.timeout_s
                )
            if run_ours:
                _log(args, "ours: ckpt_manager in the loop, local and S3 ...")
                try:
                    ours = _common.run_ranks(_ours, args.world_size, spec, timeout_s=args.timeout_s)
                except Exception as err:
                    skipped["ours"] = f"{type(err).__name__}: {str(err)[-3000:]}"
                    _log(args, f"ours failed: {skipped['ours']}")
        # After SeaweedFS stopped: the spare core must not be shared with an idle S3 server
        # (its heartbeats and scans) that only the other comparisons need.
        if run_ours and not args.no_spare_core:
            _log(args, "ours with one training rank (a spare core) ...")
            spare = _common.run_ranks(
                _spare_core, 1, {**spec, "s3": None}, timeout_s=args.timeout_s
            )
        report = _report(args, base, ours, spare, skipped, conditions_before)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        _common.print_json(report)
    else:
        print(_render(report))
    return 0


def _log(args: argparse.Namespace, msg: str) -> None:
    if not args.json:
        print(msg, file=sys.stderr, flush=True)


def _per_round(per_rank: list[list[float]]) -> list[float]:
    """The slowest rank's value in each round (a lockstep loop waits for it)."""
    return [max(values) for values in zip(*per_rank, strict=False)]


def _extra(windows: dict[str, Any], key: str) -> list[float]:
    """Per round: (saving window - window without saves) of `key` (`loop_s`, `cpu_s`)."""
    return [s[key] - n[key] for n, s in zip(windows["none"], windows["saving"], strict=True)]


def _stepwise(windows: dict[str, Any]) -> float:
    """Inflation per save from per-step medians: for each step of a window (and its drain),
    the median over rounds with a save minus the median over rounds without, summed.

    A diagnostic for noisy machines: a step the host delayed in one round moves a median
    little, while it moves that round's window sum, and so that round's inflation, by all of
    it. Rounds are not paired here, so it has no per-round spread.
    """

    def medians(kind: str) -> list[float]:
        rows = [[*w["steps_s"], w["drain_s"]] for w in windows[kind]]
        return [median(list(col)) for col in zip(*rows, strict=True)]

    return sum(s - n for s, n in zip(medians("saving"), medians("none"), strict=True))


def _a_a(plain: list[dict[str, float]]) -> list[float]:
    """|Difference| of loop time between consecutive windows without saves (the noise floor)."""
    return [abs(b["loop_s"] - a["loop_s"]) for a, b in itertools.pairwise(plain)]


def _a_a_signed(plain: list[dict[str, float]], key: str = "loop_s") -> list[float]:
    """The inflation estimator run on two save-free arms: (later - earlier) save-free window
    of consecutive rounds, signed, so its median centres on 0 and its interval is the noise
    floor of `_extra` with as many rounds."""
    return [b[key] - a[key] for a, b in itertools.pairwise(plain)]


def _spread(values: list[float] | None) -> dict[str, Any] | None:
    """Median with its bootstrap 95% interval, min, max and n of per-round values."""
    return _stats.summary(values)


def _ratio_spread(num: list[float] | None, den: list[float] | None) -> dict[str, Any] | None:
    """`median(num) / median(den)` with a bootstrap 95% interval and the widest min-max
    any pairing of rounds gives (`_stats.ratio_summary`).

    The peers run in separate sets of ranks, so rounds are not paired: each side is
    resampled on its own; min/max are None where a denominator round is at or below zero
    (noise swallowed the peer's cost in that round).
    """
    return _stats.ratio_summary(num, den)


def _peer(windows_per_rank: list[dict[str, Any]], stall_key: str | None) -> dict[str, Any]:
    """Stall, loop inflation and extra CPU per save of one peer, per round (slowest rank)."""
    out: dict[str, Any] = {
        "inflation_s": _per_round([_extra(w, "loop_s") for w in windows_per_rank]),
        "extra_cpu_s": _per_round([_extra(w, "cpu_s") for w in windows_per_rank]),
        # Diagnostics: how much of the inflation is the window's end waiting for the save to
        # finish, and the noise floor (two windows without saves, one round apart).
        "extra_drain_s": _per_round([_extra(w, "drain_s") for w in windows_per_rank]),
        "plain_window_s": _per_round([[n["loop_s"] for n in w["none"]] for w in windows_per_rank]),
        "plain_a_a_s": _per_round([_a_a(w["none"]) for w in windows_per_rank]),
        # The same estimator as `inflation_s` on two save-free arms (its noise floor).
        "inflation_a_a_s": _per_round([_a_a_signed(w["none"]) for w in windows_per_rank]),
        "extra_cpu_a_a_s": _per_round([_a_a_signed(w["none"], "cpu_s") for w in windows_per_rank]),
        "inflation_stepwise_s": [max(_stepwise(w) for w in windows_per_rank)],
    }
    if stall_key is not None:
        out["stall_s"] = _per_round([w[stall_key] for w in windows_per_rank])
    return out


def _report(
    args: argparse.Namespace,
    base: list[dict[str, Any]] | None,
    ours: list[dict[str, Any]] | None,
    spare: list[dict[str, Any]] | None,
    skipped: dict[str, str],
    conditions_before: dict[str, Any],
) -> dict[str, Any]:
    ref = base or ours
    total_bytes = sum(r["state_bytes"] for r in ref) if ref else None
    peers: dict[str, dict[str, Any]] = {}
    times: dict[str, list[float]] = {}  # one-shot timings (slowest rank), for throughput
    memcpy_s: float | None = None
    if base is not None:
        b0 = base[0]
        memcpy_s = max(r["memcpy_s"] for r in base)
        times["raw_write_s"] = b0["raw_write_s"]
        times["dcp_save_s"] = b0["dcp_save_s"]
        times["dcp_best_save_s"] = _per_round([r["dcp_best_save_s"] for r in base])
        peers["background_memcpy"] = _peer([r["copy_windows"] for r in base], None)
        peers["dcp_async"] = _peer([r["windows"] for r in base], "return_s")
        peers["dcp_best"] = _peer([r["dcp_best_windows"] for r in base], "stall_s")
        if "s3fs_pipe_s" in b0:
            times["s3fs_pipe_s"] = b0["s3fs_pipe_s"]
    save_cpu: list[float] | None = None
    fixed_cpu: list[float] | None = None
    save_cpu_paired: list[float] | None = None
    memcpy_paired: list[float] | None = None
    if ours is not None:
        o0 = ours[0]
        peers["ours"] = _peer([r["windows"] for r in ours], "stall_s")
        if memcpy_s is None:
            memcpy_s = max(r["memcpy_s"] for r in ours)
        times["ours_local_save_s"] = o0["local_save_s"]
        if "s3_save_s" in o0:
            times["ours_s3_save_s"] = o0["s3_save_s"]
        # CPU of whole saves (rank process + writer, idle loop), the costlier rank per save.
        save_cpu = _per_round(
            [[c["rank_cpu_s"] + c["writer_cpu_s"] for c in r["cpu_per_save"]] for r in ours]
        )
        fixed_cpu = _per_round([r["fixed_cpu_s"] for r in ours])
        # Each save's CPU over the memcpy timed right after it on the same rank.
        save_cpu_paired = _per_round(
            [
                [
                    (c["rank_cpu_s"] + c["writer_cpu_s"]) / c["memcpy_after_s"]
                    for c in r["cpu_per_save"]
                ]
                for r in ours
            ]
        )
        memcpy_paired = _per_round([[c["memcpy_after_s"] for c in r["cpu_per_save"]] for r in ours])
    spare_memcpy_s: float | None = None
    if spare is not None:
        spare_memcpy_s = spare[0]["memcpy_s"]
        peers["ours_spare_core"] = _peer([r["windows"] for r in spare], "stall_s")

    def per(peer: str, key: str) -> list[float] | None:
        return peers.get(peer, {}).get(key)

    def in_memcpys(values: list[float] | None, memcpy: float | None) -> list[float] | None:
        return [v / memcpy for v in values] if values and memcpy else None

    def thr(key: str) -> float | None:
        t = times.get(key)
        return total_bytes / median(t) / MIB if t and total_bytes else None

    per_rank_bytes = [r["state_bytes"] for r in ref] if ref else []
    report: dict[str, Any] = {
        "stall_vs_dcp_best": _ratio_spread(per("ours", "stall_s"), per("dcp_best", "stall_s")),
        "inflation_vs_dcp_best": _ratio_spread(
            per("ours", "inflation_s"), per("dcp_best", "inflation_s")
        ),
        "save_cpu_vs_memcpy": _spread(in_memcpys(save_cpu, memcpy_s)),
        # Diagnostic: the same saves, each over a memcpy of the state timed right after it
        # (every rank at once), instead of over the fastest of the memcpys before the run:
        # on a machine whose memory speed moves, the fastest memcpy is below the saves'
        # typical one (BENCHMARKS.md, issue 33, helper `savecpu`).
        "save_cpu_vs_memcpy_paired": _spread(save_cpu_paired),
        "memcpy_paired_s": _spread(memcpy_paired),
        # What a save costs beyond copy, checksum and write (`_fixed_cpu`), in seconds and
        # in memcpys of the state.
        "save_fixed_cpu_s": _spread(fixed_cpu),
        "save_fixed_vs_memcpy": _spread(in_memcpys(fixed_cpu, memcpy_s)),
        "inflation_vs_memcpy_spare_core": _spread(
            in_memcpys(per("ours_spare_core", "inflation_s"), spare_memcpy_s)
        ),
        # The noise floors of the two inflation keys: the same estimators on two save-free
        # arms (`_a_a_signed`), in the keys' units.
        "inflation_vs_dcp_best_a_a": _ratio_spread(
            per("ours", "inflation_a_a_s"), per("dcp_best", "inflation_s")
        ),
        "inflation_vs_memcpy_spare_core_a_a": _spread(
            in_memcpys(per("ours_spare_core", "inflation_a_a_s"), spare_memcpy_s)
        ),
        # Diagnostic: the extra CPU of the whole process tree per save in the loop (what
        # inflates a loop that uses every core), in memcpys, and its own A/A floor.
        "extra_cpu_vs_memcpy": _spread(in_memcpys(per("ours", "extra_cpu_s"), memcpy_s)),
        "extra_cpu_vs_memcpy_a_a": _spread(in_memcpys(per("ours", "extra_cpu_a_a_s"), memcpy_s)),
        # Throughput ratios: ours / the peer's = the peer's time / ours.
        "local_write_vs_raw": _ratio_spread(
            times.get("raw_write_s"), times.get("ours_local_save_s")
        ),
        "s3_write_vs_s3fs": _ratio_spread(times.get("s3fs_pipe_s"), times.get("ours_s3_save_s")),
        # Diagnostic: against DCP's default (THREAD saver, blocking staging copy).
        "stall_vs_dcp_async": _ratio_spread(per("ours", "stall_s"), per("dcp_async", "stall_s")),
        "inflation_vs_memcpy": _spread(in_memcpys(per("ours", "inflation_s"), memcpy_s)),
        # Diagnostic, robust to a host that delays single steps (`_stepwise`).
        "inflation_vs_memcpy_spare_core_stepwise": _spread(
            in_memcpys(per("ours_spare_core", "inflation_stepwise_s"), spare_memcpy_s)
        ),
        "targets": {
            "stall_vs_dcp_best": ("<=", 0.25),
            "inflation_vs_dcp_best": ("<=", 0.25),
            "save_cpu_vs_memcpy": ("<=", 2.0),
            # 0.25 memcpy of the state, in seconds (issue 33).
            "save_fixed_cpu_s": ("<=", 0.25 * memcpy_s if memcpy_s else None),
            "inflation_vs_memcpy_spare_core": ("<=", 0.5),
            "local_write_vs_raw": (">=", 0.9),
            "s3_write_vs_s3fs": (">=", 0.9),
        },
        # One memcpy of the state (the unit of every *_vs_memcpy key) as a rate: a machine
        # with fast memory makes the fixed per-save work a larger share.
        "memcpy_gib_s": sum(per_rank_bytes) / len(per_rank_bytes) / memcpy_s / 2**30
        if per_rank_bytes and memcpy_s
        else None,
        "peers": {name: {k: _spread(v) for k, v in p.items()} for name, p in peers.items()},
        "peers_per_round": peers,
        "memcpy_s": memcpy_s,
        "memcpy_wall_s": max(r["memcpy_wall_s"] for r in ref) if ref else None,
        "spare_core_memcpy_s": spare_memcpy_s,
        "save_cpu_per_save_s": _spread(save_cpu),
        "one_shot_s": {k: _spread(v) for k, v in times.items()},
        "throughput_mib_s": {
            k.removesuffix("_s"): thr(k)
            for k in (
                "raw_write_s",
                "dcp_save_s",
                "dcp_best_save_s",
                "ours_local_save_s",
                "s3fs_pipe_s",
                "ours_s3_save_s",
            )
        },
        "state_bytes_total": total_bytes,
        "state_bytes_per_rank": [r["state_bytes"] for r in ref] if ref else None,
        "ours_first_save_s": max(r["first_save_s"] for r in ours) if ours else None,
        "dcp_first_async_save_s": max(r["dcp_first_async_save_s"] for r in base) if base else None,
        "ours_reports_rank0": {
            k: ours[0][k] for k in ("local_reports", "s3_reports") if k in ours[0]
        }
        if ours
        else None,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "conditions_before": conditions_before,
        "conditions_after": _common.machine_conditions(),
        "skipped": skipped,
    }
    if base is not None and "s3fs_pipe_s" in base[0]:
        skipped.setdefault(
            "dcp_s3", "DCP to S3 needs its fsspec writer and a bucket layout of its own: not run"
        )
    _judge(report)
    return report


_NOISE_FLOORED = ("inflation_vs_dcp_best", "inflation_vs_memcpy_spare_core")
"""Keys measured as a difference of wall-clock windows: each has an A/A key (`<key>_a_a`)."""


def _judge(report: dict[str, Any]) -> None:
    """Verdicts on the intervals' bad ends; a wall-clock key whose A/A noise floor is not
    below a quarter of its target becomes null, with the reason in `unresolved`."""
    unresolved: dict[str, str] = {}
    for key in _NOISE_FLOORED:
        if report.get(key) is None:
            continue
        why = _stats.resolved(report.get(f"{key}_a_a"), report["targets"][key][1])
        if why is not None:
            unresolved[key] = why
            report[key] = None
    verdicts: dict[str, str] = {}
    for key, (op, target) in report["targets"].items():
        if key in unresolved:
            verdicts[key] = "unresolved on this machine"
        elif target is None:
            verdicts[key] = "n/a"
        else:
            verdicts[key] = _stats.verdict(report.get(key), op, target)
    report["unresolved"] = unresolved
    report["verdicts"] = verdicts


def _render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    per_rank = report["state_bytes_per_rank"]
    lines = [
        f"{cfg['world_size']} gloo ranks, state "
        + (", ".join(f"{b / MIB:.0f}" for b in per_rank) if per_rank else "n/a")
        + f" MiB per rank (GPT {LAYERS} blocks + AdamW), {cfg['pairs']} rounds of "
        f"{cfg['every']}-step window pairs (no save, one save) per peer, async mode "
        f"{cfg['async_mode']}; one memcpy of the state {_common._cell(report['memcpy_s'])} s "
        f"of CPU ({_common._cell(report['memcpy_gib_s'])} GiB/s)",
        "",
    ]

    def cell(spread: dict[str, Any] | None) -> str:
        if spread is None:
            return "n/a"
        text = f"{spread['median']:.3f}"
        if spread.get("ci95_lo") is not None:
            text += f" [95% {spread['ci95_lo']:.3f}-{spread['ci95_hi']:.3f}]"
        if spread.get("min") is not None:
            text += f" ({spread['min']:.3f}-{spread['max']:.3f})"
        return text

    names = {
        "background_memcpy": "background memcpy only (floor)",
        "dcp_async": "DCP async_save, default (THREAD)",
        "dcp_best": "DCP async_save, PROCESS + async shm stager",
        "ours": "ours",
        "ours_spare_core": "ours, 1 rank (spare core)",
    }
    rows = [
        [
            names[name],
            cell(p.get("stall_s")),
            cell(p.get("inflation_s")),
            cell(p.get("extra_cpu_s")),
        ]
        for name, p in report["peers"].items()
    ]
    lines.append(
        _common.markdown_table(
            [
                "peer (median [bootstrap 95%] (min-max) over rounds)",
                "stall s/save",
                "inflation s/save",
                "extra CPU-s/save",
            ],
            rows,
        )
    )
    lines.append("")
    thr = report["throughput_mib_s"]
    lines.append(
        _common.markdown_table(
            ["write, idle loop", "MiB/s (all ranks)"],
            [[k, v] for k, v in thr.items() if v is not None],
        )
    )
    lines.append("")
    for key, (op, target) in report["targets"].items():
        why = report["unresolved"].get(key)
        value = why if why is not None else cell(report.get(key))
        goal = "n/a" if target is None else f"{target:.4g}"
        lines.append(f"{key}: {value} (target {op} {goal}) {report['verdicts'][key]}")
    for key in _NOISE_FLOORED:
        lines.append(f"{key}_a_a (noise floor): {cell(report.get(key + '_a_a'))}")
    for name, why in report.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why.splitlines()[0] if why else ''}")
    diagnostics = ("stall_vs_dcp_async", "inflation_vs_memcpy", "save_fixed_vs_memcpy")
    diagnostics += ("extra_cpu_vs_memcpy", "extra_cpu_vs_memcpy_a_a")
    diagnostics += ("save_cpu_vs_memcpy_paired", "memcpy_paired_s")
    for key in diagnostics:
        lines.append(f"{key}: {cell(report.get(key))} (no target)")
    lines.append(_common.conditions_line(report["conditions_before"], report["conditions_after"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
