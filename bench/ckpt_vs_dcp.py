"""Benchmark: our checkpoint manager vs torch DCP, raw writes and plain s3fs.

One invocation, 2 gloo ranks, each training its own GPT replica (`daemon.gpt`, AdamW) sized so
that parameters plus optimizer state are at least `--size-mib` per rank (default 512 MiB).
Every rank's state is distinct: DCP gets rank-tagged keys (it silently deduplicates equal
keys), our manager gets each tensor as that rank's shard of a `(world, ...)` tensor.

Two fresh sets of ranks run, one after the other: the baselines (one memcpy of the state, a
raw sequential write + fsync of the same bytes, blocking `dcp.save`, DCP `async_save` inside
the training loop, plain s3fs `pipe_file` to SeaweedFS) and ours (`ckpt_manager`), so that the
two never share memory or background threads. Measured:

- stall per save: wall time the loop is blocked by checkpointing: inside `save()` plus the
  wait in `before_optimizer_step()` (ours); the return time of `async_save` (DCP);
- inflation per save: windows of `--every` training steps, one save at the start of every
  other window, in `--pairs` (no save, one save) pairs run in ABBA order; a saving window
  ends by waiting for its save to finish (inside the timing), so everything the save costs
  the loop lands in its window. Inflation is the median over pairs of (saving window -
  plain window); also the extra CPU seconds per save (the rank process plus our writer
  process): with training using every core, CPU spent on checkpointing is what inflates it;
- local throughput: state bytes of all ranks / wall time from `save()` to committed, idle
  loop; vs all ranks writing the same bytes to one file each with fsync, same directory;
- S3 throughput: the same against SeaweedFS on loopback vs plain s3fs `pipe_file`.

One untimed save precedes the windows on both sides (DCP caches its plan; ours allocates its
staging memory): the first save of a run is reported separately. Targets: stall <= 0.1x DCP
async_save, inflation <= 1.5x one memcpy, local >= 0.8x raw,
S3 >= 0.8x s3fs.

    .venv/bin/python bench/ckpt_vs_dcp.py                  # 512 MiB per rank, table
    .venv/bin/python bench/ckpt_vs_dcp.py --size-mib 32    # quick smoke run
    .venv/bin/python bench/ckpt_vs_dcp.py --json           # one JSON object
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib
import math
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
from _common import MIB, median, ratio

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

        from daemon.gpt import GPT, GPTConfig

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

        from daemon.gpt import lm_loss

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


def _memcpy_s(trainer: _Trainer, repeats: int) -> float:
    import torch

    tensors = [t for _, t in trainer.named_tensors()]
    dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors, strict=True):  # first touch outside the timing
        d.copy_(t)
    times = []
    # The fastest of several: a memcpy is fixed work, so the minimum is the best estimate of
    # its cost; on a loaded machine a median picks up time slices lost to other processes.
    for _ in range(max(5, repeats)):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        times.append(time.perf_counter() - t0)
    return min(times)


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


def _reaped_children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _window(
    trainer: _Trainer,
    steps: int,
    cpu_pids: list[int],
    save: Any = None,
    before_optimizer: Any = None,
    after_optimizer: Any = None,
    drain: Any = None,
) -> dict[str, float]:
    """`steps` training steps; with `save`, one save after the first optimizer step.

    `before_optimizer()` and `after_optimizer()` run around every optimizer step (our fence,
    our `maybe_finalize()`); `drain()` runs at the end, inside the timing, so a save still
    writing when the window ends is paid for here.
    CPU seconds are this process's plus those of `cpu_pids` (our writer process).
    """
    cpu0 = _cpu_s() + sum(_cpu_s(p) for p in cpu_pids)
    t0 = time.perf_counter()
    hooks_s = 0.0  # time inside the checkpointing calls (where the loop waits, if anywhere)
    for i in range(steps):
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
        hooks_s += (t2 - t1) + (time.perf_counter() - t3)
    t4 = time.perf_counter()
    if drain is not None:
        drain()
    end = time.perf_counter()
    return {
        "loop_s": end - t0,
        "cpu_s": _cpu_s() + sum(_cpu_s(p) for p in cpu_pids) - cpu0,
        "hooks_s": hooks_s,
        "drain_s": end - t4,
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
        lambda: _window(trainer, spec["every"], [], before_optimizer=fence),
        lambda: _window(trainer, spec["every"], [], save=save, before_optimizer=fence),
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
        result = _window(trainer, spec["every"], [], save=save, drain=drain)
        _rank0_rmtree(rank, root)
        return result

    windows: dict[str, Any] = _window_pairs(
        spec["pairs"], lambda: _window(trainer, spec["every"], []), saving
    )
    # The first (untimed) pair's save is the one that builds DCP's cached plan.
    windows["return_s"] = returns[1:]
    return windows


def _baselines(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    _common.stdout_to_stderr()
    trainer = _Trainer(spec, rank)
    root = Path(spec["dir"]) / "baselines"
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"state_bytes": trainer.num_bytes(), "d_model": trainer.cfg.d_model}

    out["memcpy_s"] = _memcpy_s(trainer, spec["repeats"])

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
        pid = mgr.writer_pid  # the persistent writer; a restart would show as a new pid
        return _window(
            trainer,
            spec["every"],
            [pid] if pid else [],
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
    """
    state = trainer.manager_state(rank, world_size)
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
        out.append({"rank_cpu_s": _cpu_s() - rank0, "writer_cpu_s": writer})
    return out


def _ours(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    _common.stdout_to_stderr()
    trainer = _Trainer(spec, rank)
    root = Path(spec["dir"]) / "ours"
    out: dict[str, Any] = {"state_bytes": trainer.num_bytes()}

    mgr, observer = _manager(str(root / "local"), spec, {})
    with mgr:
        # The first save of a run allocates and first-touches the staging memory: reported,
        # then kept out of the steady-state figures.
        out["first_save_s"] = _idle_saves(trainer, mgr, rank, world_size, 1)[0]
        out["windows"] = _our_windows(trainer, mgr, rank, world_size, spec)
        out["local_save_s"] = _idle_saves(trainer, mgr, rank, world_size, spec["repeats"])
        out["cpu_per_save"] = _cpu_per_save(trainer, mgr, rank, world_size, 5)
    out["local_reports"] = [r._asdict() for r in observer.reports]
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
    p.add_argument("--pairs", type=int, default=8, help="(no save, one save) window pairs")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each local one-shot timing")
    p.add_argument("--s3-repeats", type=int, default=2, help="repeats of each S3 timing")
    p.add_argument("--async-mode", default="persistent", help="our AsyncMode (default persistent)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="local directory to write into (default: tmp)")
    p.add_argument("--no-s3", action="store_true", help="skip the SeaweedFS comparison")
    p.add_argument("--only", choices=("baselines", "ours", "both"), default="both")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per set of ranks")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if min(args.size_mib, args.repeats, args.s3_repeats, args.pairs) < 1:
        p.error("--size-mib, --repeats, --s3-repeats, --pairs must be >= 1")
    if args.every < 2:
        p.error("--every must be >= 2 (a save needs following steps to overlap with)")
    return args


def _window_figures(windows: dict[str, Any]) -> dict[str, Any]:
    """Inflation per save: the median over pairs of (saving window - window without saves)."""
    none, saving = windows["none"], windows["saving"]
    extra = [s["loop_s"] - n["loop_s"] for n, s in zip(none, saving, strict=True)]
    extra_cpu = [s["cpu_s"] - n["cpu_s"] for n, s in zip(none, saving, strict=True)]
    out = {
        "window_none_s": [r["loop_s"] for r in none],
        "window_saving_s": [r["loop_s"] for r in saving],
        "inflation_per_save_s": median(extra),
        "inflation_per_save_mean_s": sum(extra) / len(extra),
        "inflation_per_pair_s": extra,
        "extra_cpu_per_save_s": median(extra_cpu),
        "hooks_per_save_s": median(r["hooks_s"] for r in saving),
        "drain_per_save_s": median(r["drain_s"] for r in saving),
    }
    if "stall_s" in windows:
        out["stall_per_save_s"] = median(windows["stall_s"])
        out["stall_max_s"] = max(windows["stall_s"])
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
                "async_mode": args.async_mode,
                "seed": args.seed,
                "dir": str(work / "local"),
                "s3": s3,
            }
            base: list[dict[str, Any]] | None = None
            ours: list[dict[str, Any]] | None = None
            if args.only in ("baselines", "both"):
                _log(args, "baselines: memcpy, raw write, dcp.save, dcp.async_save, s3fs ...")
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
        report = _report(args, base, ours, skipped, conditions_before)
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


def _report(
    args: argparse.Namespace,
    base: list[dict[str, Any]] | None,
    ours: list[dict[str, Any]] | None,
    skipped: dict[str, str],
    conditions_before: dict[str, Any],
) -> dict[str, Any]:
    ref = base or ours
    total_bytes = sum(r["state_bytes"] for r in ref) if ref else None
    figures: dict[str, Any] = {}
    if base is not None:
        b0 = base[0]
        figures["memcpy_s"] = max(r["memcpy_s"] for r in base)
        figures["raw_write_s"] = median(b0["raw_write_s"])
        figures["dcp_save_s"] = median(b0["dcp_save_s"])
        dcp_loops = [_window_figures(r["windows"]) for r in base]
        figures["dcp_async_return_s"] = median(t for r in base for t in r["windows"]["return_s"])
        figures["dcp_first_async_save_s"] = max(r["dcp_first_async_save_s"] for r in base)
        figures["dcp_async_inflation_s"] = max(f["inflation_per_save_s"] for f in dcp_loops)
        figures["dcp_loop_per_rank"] = dcp_loops
        copy_loops = [_window_figures(r["copy_windows"]) for r in base]
        figures["bg_copy_inflation_s"] = max(f["inflation_per_save_s"] for f in copy_loops)
        figures["bg_copy_loop_per_rank"] = copy_loops
        if "s3fs_pipe_s" in b0:
            figures["s3fs_pipe_s"] = median(b0["s3fs_pipe_s"])
    if ours is not None:
        o0 = ours[0]
        our_loops = [_window_figures(r["windows"]) for r in ours]
        figures["ours_stall_s"] = max(f["stall_per_save_s"] for f in our_loops)
        figures["ours_inflation_s"] = max(f["inflation_per_save_s"] for f in our_loops)
        figures["ours_first_save_s"] = max(r["first_save_s"] for r in ours)
        figures["ours_loop_per_rank"] = our_loops
        figures["ours_local_save_s"] = median(o0["local_save_s"])
        # Per-rank medians; the costlier rank is what a lockstep loop would wait for.
        for part in ("rank", "writer"):
            figures[f"ours_{part}_cpu_per_save_s"] = max(
                median(c[f"{part}_cpu_s"] for c in r["cpu_per_save"]) for r in ours
            )
        if "s3_save_s" in o0:
            figures["ours_s3_save_s"] = median(o0["s3_save_s"])
        figures["ours_reports_rank0"] = {
            k: o0[k] for k in ("local_reports", "s3_reports") if k in o0
        }

    def thr(key: str) -> float | None:
        t = figures.get(key)
        return total_bytes / t / MIB if t and total_bytes else None

    report: dict[str, Any] = {
        "stall_vs_dcp_async": ratio(figures.get("ours_stall_s"), figures.get("dcp_async_return_s")),
        "inflation_vs_memcpy": ratio(figures.get("ours_inflation_s"), figures.get("memcpy_s")),
        "local_write_vs_raw": ratio(thr("ours_local_save_s"), thr("raw_write_s")),
        "s3_write_vs_s3fs": ratio(thr("ours_s3_save_s"), thr("s3fs_pipe_s")),
        # Not a target: the CPU a whole save costs (rank + writer process, idle loop) in
        # memcpys, noise-free; a loop with no idle core pays at least this much wall time
        # minus what it can absorb.
        "save_cpu_vs_memcpy": ratio(
            _sum_known(
                figures.get("ours_rank_cpu_per_save_s"), figures.get("ours_writer_cpu_per_save_s")
            ),
            figures.get("memcpy_s"),
        ),
        # Not a target: ours against the floor of any async snapshot on this machine (None
        # when noise put that floor at or below zero).
        "inflation_vs_background_memcpy": ratio(
            figures.get("ours_inflation_s"),
            floor if (floor := figures.get("bg_copy_inflation_s")) and floor > 0 else None,
        ),
        "targets": {
            "stall_vs_dcp_async": ("<=", 0.1),
            "inflation_vs_memcpy": ("<=", 1.5),
            "local_write_vs_raw": (">=", 0.8),
            "s3_write_vs_s3fs": (">=", 0.8),
        },
        "throughput_mib_s": {
            k: thr(f"{k}_s")
            for k in ("raw_write", "dcp_save", "ours_local_save", "s3fs_pipe", "ours_s3_save")
        },
        "state_bytes_total": total_bytes,
        "state_bytes_per_rank": [r["state_bytes"] for r in ref] if ref else None,
        "figures": figures,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "conditions_before": conditions_before,
        "conditions_after": _common.machine_conditions(),
        "skipped": skipped,
    }
    return report


def _sum_known(*values: float | None) -> float | None:
    """The sum, or None if any value is missing."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _cpu(figures: dict[str, Any], key: str) -> float | None:
    per_rank = figures.get(key)
    return max(r["extra_cpu_per_save_s"] for r in per_rank) if per_rank else None


def _render(report: dict[str, Any]) -> str:
    f = report["figures"]
    thr = report["throughput_mib_s"]
    cfg = report["config"]
    per_rank = report["state_bytes_per_rank"]
    lines = [
        f"{cfg['world_size']} gloo ranks, state "
        + (", ".join(f"{b / MIB:.0f}" for b in per_rank) if per_rank else "n/a")
        + f" MiB per rank (GPT {LAYERS} blocks + AdamW), {cfg['pairs']} pairs of "
        f"{cfg['every']}-step windows (no save, one save), async mode {cfg['async_mode']}",
        "",
    ]
    rows = [
        ["one memcpy of the state", f.get("memcpy_s"), None],
        ["raw sequential write + fsync", f.get("raw_write_s"), thr["raw_write"]],
        ["dcp.save (blocking)", f.get("dcp_save_s"), thr["dcp_save"]],
        ["dcp.async_save: return time", f.get("dcp_async_return_s"), None],
        ["background memcpy only: inflation/save", f.get("bg_copy_inflation_s"), None],
        ["dcp.async_save: inflation/save", f.get("dcp_async_inflation_s"), None],
        ["dcp.async_save: extra CPU-s/save", _cpu(f, "dcp_loop_per_rank"), None],
        ["ours: stall/save", f.get("ours_stall_s"), None],
        ["ours: inflation/save", f.get("ours_inflation_s"), None],
        ["ours: extra CPU-s/save (trainer+writer)", _cpu(f, "ours_loop_per_rank"), None],
        ["ours: CPU-s/save, rank process (idle loop)", f.get("ours_rank_cpu_per_save_s"), None],
        ["ours: CPU-s/save, writer (idle loop)", f.get("ours_writer_cpu_per_save_s"), None],
        ["ours: first save of a run to committed", f.get("ours_first_save_s"), None],
        ["ours: local save to committed", f.get("ours_local_save_s"), thr["ours_local_save"]],
        ["s3fs pipe_file to SeaweedFS", f.get("s3fs_pipe_s"), thr["s3fs_pipe"]],
        ["ours: S3 save to committed", f.get("ours_s3_save_s"), thr["ours_s3_save"]],
    ]
    lines.append(
        _common.markdown_table(
            ["measure", "seconds", "MiB/s (all ranks)"], [r for r in rows if r[1] is not None]
        )
    )
    lines.append("")
    lines += _common.verdict_lines(report)
    lines += _common.diagnostic_lines(
        report, ("save_cpu_vs_memcpy", "inflation_vs_background_memcpy")
    )
    lines.append(_common.conditions_line(report["conditions_before"], report["conditions_after"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
