"""What one memory snapshot costs the training thread, part by part (issue 29, item 1).

Runs the real training loop (`daemon.rank.loop.run_training`) of the default job on `--ranks`
gloo ranks (forked, as the tests' `run_on_ranks`) with the memory tier on at `--memory-every`
(steps, or `auto`: then it also reports the last snapshot costs the cadence was fed, the
excess it measured in the step after a snapshot, and the interval it chose), and times, on the
training thread only, each part of every snapshot:

- `state()`: `model` (`sharded_state_dict`, incl. `wait_weights`, the wait for deferred
  weight gathers), `optimizer`, `scheduler`, `loader`, `rng`;
- `save(durable=False)`: `flatten`, `leaves`, `plan` (the durable file's cached plan),
  `begin` (slot choice), `memory_only` (the request), `submit` (hand-off to the stager),
  `collect` (records finished snapshots), and `save` itself (all of it);
- `fence`: the next optimizer step's `before_optimizer_step` (waits for the staging copy);
- `gc`: the garbage collector's passes that ran on the training thread inside the window.

Each part has its wall time and its thread CPU time (`time.thread_time`). `stall` is what
the loop reports as `trainingd_memory_snapshot_seconds` (the call plus the fence wait). The
staging thread's side is timed too: `stager_wait` (submit to the job's start: the queue and
the GIL) and `stager_run`. Percentiles (p50/p90/p99/max) over all snapshots of all ranks, and
the mean of each part over the snapshots in the top 1% of `stall` (what makes the tail).

    .venv/bin/python bench/snapshot_stall.py --steps 300 --json
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import gc
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common
from _recovery import job as bench_job


class _Probe:
    """Per-snapshot part timings on the training thread (one per rank process)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.active = False
        self.current: dict[str, list[float]] | None = None
        self.records: list[dict[str, list[float]]] = []
        self.gc_start: tuple[float, float] | None = None
        self.stager: list[tuple[float, float, float]] = []  # wait, run wall, run cpu
        self.fence_copy_pending = 0
        self.fences = 0
        self.gc_any_start = 0.0
        self.gc_run: dict[int, list[float]] = {}  # generation -> [count, seconds], whole run
        # (snapshot cost fed, the step-after excess measured, interval after)
        self.cadence: list[tuple[float, float | None, int]] = []
        self.profiler: cProfile.Profile | None = None  # `--profile-stager`
        self.call_profiler: cProfile.Profile | None = None  # `--profile-call`
        self.profile_after = 0

    def add(self, part: str, wall: float, cpu: float) -> None:
        if self.current is not None:
            acc = self.current.setdefault(part, [0.0, 0.0])
            acc[0] += wall
            acc[1] += cpu

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self.gc_any_start = time.perf_counter()
        else:
            acc = self.gc_run.setdefault(int(info["generation"]), [0, 0.0])
            acc[0] += 1
            acc[1] += time.perf_counter() - self.gc_any_start
        if not self.active:
            return
        if phase == "start":
            self.gc_start = (time.perf_counter(), time.thread_time())
        elif self.gc_start is not None:
            w0, c0 = self.gc_start
            self.add("gc", time.perf_counter() - w0, time.thread_time() - c0)
            self.gc_start = None


def _timed(probe: _Probe, owner: Any, name: str, part: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not probe.active or threading.get_ident() != probe.thread:
            return original(*args, **kwargs)
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            probe.add(part, time.perf_counter() - w0, time.thread_time() - c0)

    setattr(owner, name, wrapper)


def _instrument(probe: _Probe) -> None:
    import torch

    from ckpt_manager import _manager
    from ckpt_manager._save import pipeline, snapshots
    from ckpt_manager._save import plan as save_plan
    from daemon.rank import loop, prefetch
    from sharding import _engine, _optimizer, _wrapper

    _timed(probe, _wrapper.FullyShardedDataParallel, "sharded_state_dict", "model")
    _timed(probe, _engine.Engine, "wait_pending_weights", "wait_weights")
    _timed(probe, _optimizer.DistributedOptimizer, "sharded_state_dict", "optimizer")
    _timed(probe, torch.optim.lr_scheduler.LambdaLR, "state_dict", "scheduler")
    _timed(probe, prefetch.PrefetchingLoader, "state_dict", "loader")
    _timed(probe, loop, "_rng_state", "rng")
    _timed(probe, _manager, "flatten", "flatten")
    _timed(probe, _manager, "leaves_to_write", "leaves")
    _timed(probe, save_plan.PlanCache, "plan", "plan")
    _timed(probe, snapshots.Snapshots, "begin", "begin")
    _timed(probe, snapshots.Snapshots, "memory_only", "memory_only")
    _timed(probe, snapshots.Snapshots, "collect", "collect")
    _timed(probe, _manager.CheckpointManager, "save", "save")
    _timed(probe, loop._Training, "state", "state")
    gc.callbacks.append(probe.on_gc)
    from daemon.rank import memory_cadence

    observe = memory_cadence.AdaptiveCadence.observe_snapshot

    def observe_snapshot(self: Any, step: int, snapshot_s: float, stall_s: float) -> None:
        observe(self, step, snapshot_s, stall_s)
        probe.cadence.append((snapshot_s, self.smoothed_excess_s, self.interval))

    memory_cadence.AdaptiveCadence.observe_snapshot = observe_snapshot  # type: ignore[method-assign]

    snapshot_to_memory = loop._Training.snapshot_to_memory

    def snapshot(self: Any, step: int) -> None:
        probe.current = {}
        probe.active = True
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            if probe.call_profiler is not None and len(probe.records) >= probe.profile_after:
                probe.call_profiler.runcall(snapshot_to_memory, self, step)
            else:
                snapshot_to_memory(self, step)
        finally:
            probe.add("call", time.perf_counter() - w0, time.thread_time() - c0)
            probe.active = False

    loop._Training.snapshot_to_memory = snapshot  # type: ignore[method-assign]

    before = _manager.CheckpointManager.before_optimizer_step

    def fence(self: Any) -> None:
        if probe.current is None:
            before(self)
            return
        probe.fences += 1
        pending = self._snapshots.uncopied() if self._snapshots is not None else []
        probe.fence_copy_pending += bool(pending)
        probe.active = True
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            before(self)
        finally:
            probe.add("fence", time.perf_counter() - w0, time.thread_time() - c0)
            probe.active = False

    _manager.CheckpointManager.before_optimizer_step = fence  # type: ignore[method-assign]

    feed = loop._Training._feed_cadence

    def feed_cadence(self: Any, agreed: Any, step_s: float) -> None:
        if self._snapshot_step is not None and probe.current is not None:
            probe.current["stall"] = [self._snapshot_cost_s, 0.0]
            probe.current["step"] = [step_s, 0.0]
            probe.records.append(probe.current)
            probe.current = None
        feed(self, agreed, step_s)

    loop._Training._feed_cadence = feed_cadence  # type: ignore[method-assign]

    submit = pipeline.LocalPipeline.submit

    def timed_submit(self: Any, request: Any) -> None:
        if self._stager is None:
            submit(self, request)
            return
        queued = time.perf_counter()
        stage = self._stage_and_dispatch

        def job() -> None:
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                if probe.profiler is not None and len(probe.stager) >= probe.profile_after:
                    probe.profiler.runcall(stage, request)
                else:
                    stage(request)
            finally:
                probe.stager.append(
                    (w0 - queued, time.perf_counter() - w0, time.thread_time() - c0)
                )

        self._stager.submit(job)

    pipeline.LocalPipeline.submit = timed_submit  # type: ignore[method-assign]
    _timed(probe, pipeline.LocalPipeline, "submit", "submit")


def _rank(rank: int, world_size: int, root: str, memory_dir: str, args: dict[str, Any]) -> Any:
    import torch

    from daemon._config_load import load_config
    from daemon.jobs.job import JobContext
    from daemon.rank.loop import run_training
    from daemon.rank.telemetry import NullTelemetry
    from daemon.rundir.control import RankControl

    _common.stdout_to_stderr()
    if args["state_mib"]:
        # The recovery bench's `big` job: the default GPT plus a ballast of that many MiB.
        os.environ[bench_job.STATE_MIB_ENV] = str(args["state_mib"])
    probe = _Probe()
    if args["profile_stager"]:
        probe.profiler = cProfile.Profile()
    if args["profile_call"]:
        probe.call_profiler = cProfile.Profile()
    probe.profile_after = args["skip"]
    _instrument(probe)
    cfg = load_config(
        {
            "ckpt_uri": f"{root}/ckpt",
            "max_steps": str(args["steps"]),
            "ckpt_every": str(args["ckpt_every"]),
            "memory_every": str(args["memory_every"]),
            "memory_dir": memory_dir,
            "run_id": "stallbench",
            "device": "cpu",
            **({"strategy": "no_shard"} if args["state_mib"] else {}),
        },
        env={},
    )
    cfg.memory_tier_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = bench_job.build(JobContext(rank=rank, world_size=world_size, seed=0))

    job = dataclasses.replace(spec, sample=None)
    run_training(
        cfg, job, telemetry=NullTelemetry(), control=RankControl(None, graceful_signals=False)
    )
    if probe.profiler is not None:
        probe.profiler.dump_stats(f"{args['profile_stager']}.rank{rank}")
    if probe.call_profiler is not None:
        probe.call_profiler.dump_stats(f"{args['profile_call']}.rank{rank}")
    return {
        "cadence": probe.cadence,
        "gc_run": probe.gc_run,
        "records": probe.records,
        "stager": probe.stager,
        "fences": probe.fences,
        "fence_copy_pending": probe.fence_copy_pending,
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": _pct(values, 0.5) * 1e3,
        "p90": _pct(values, 0.9) * 1e3,
        "p99": _pct(values, 0.99) * 1e3,
        "max": max(values, default=0.0) * 1e3,
        "mean": (statistics.fmean(values) if values else 0.0) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--memory-every", default="1", help="steps, or auto")
    parser.add_argument(
        "--state-mib",
        type=int,
        default=0,
        help="extra state per rank (the recovery bench's big job)",
    )
    parser.add_argument(
        "--ckpt-every", type=int, default=0, help="durable saves too, every N steps (0: none)"
    )
    parser.add_argument("--skip", type=int, default=5, help="first snapshots left out (warm-up)")
    parser.add_argument(
        "--profile-stager",
        metavar="PREFIX",
        help="cProfile the staging thread's jobs after the warm-up into PREFIX.rank<N>",
    )
    parser.add_argument(
        "--profile-call",
        metavar="PREFIX",
        help="cProfile the training thread's snapshot calls after the warm-up into PREFIX.rank<N>",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        results = _common.run_ranks(
            _rank,
            args.ranks,
            root,
            shm,
            {
                "steps": args.steps,
                "memory_every": args.memory_every,
                "state_mib": args.state_mib,
                "ckpt_every": args.ckpt_every,
                "profile_stager": args.profile_stager,
                "profile_call": args.profile_call,
                "skip": args.skip,
            },
            timeout_s=60 + args.steps * 3.0,
        )
    records = [rec for r in results for rec in r["records"][args.skip :]]
    parts = sorted({p for rec in records for p in rec})
    table: dict[str, Any] = {}
    for part in parts:
        wall = [rec.get(part, [0.0, 0.0])[0] for rec in records]
        cpu = [rec.get(part, [0.0, 0.0])[1] for rec in records]
        table[part] = {"wall_ms": _summary(wall), "cpu_ms": _summary(cpu)}
    stalls = sorted(records, key=lambda rec: rec["stall"][0])
    tail = stalls[-max(1, len(stalls) // 100) :]
    tail_parts = {
        part: statistics.fmean(rec.get(part, [0.0, 0.0])[0] for rec in tail) * 1e3 for part in parts
    }
    stager = [s for r in results for s in r["stager"][args.skip :]]
    out = {
        "snapshots": len(records),
        "parts": table,
        "tail_mean_wall_ms": tail_parts,
        "stager_wait_ms": _summary([s[0] for s in stager]),
        "stager_run_wall_ms": _summary([s[1] for s in stager]),
        "stager_run_cpu_ms": _summary([s[2] for s in stager]),
        "fences_with_copy_pending": sum(r["fence_copy_pending"] for r in results),
        "fences": sum(r["fences"] for r in results),
        "gc_whole_run_training_thread": [r["gc_run"] for r in results],
        # memory_every auto: the cost fed to the cadence (ms), the excess it measured in the
        # step after a snapshot (ms) and the interval it chose, the last 5 snapshots of rank 0
        # (every rank is fed the same agreed values).
        "auto_cadence_tail": [
            (c * 1e3, None if x is None else x * 1e3, n) for c, x, n in results[0]["cadence"][-5:]
        ],
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['snapshots']} snapshots; load {out['loadavg']}")
        print(
            f"{'part':14s} {'wall p50':>9s} {'p99':>8s} {'max':>8s} {'cpu p50':>8s} {'p99':>8s}"
            "  tail"
        )
        for part, row in table.items():
            w, c = row["wall_ms"], row["cpu_ms"]
            print(
                f"{part:14s} {w['p50']:9.2f} {w['p99']:8.2f} {w['max']:8.2f} {c['p50']:8.2f} "
                f"{c['p99']:8.2f}  {tail_parts[part]:7.2f}"
            )
        for key in ("stager_wait_ms", "stager_run_wall_ms", "stager_run_cpu_ms"):
            s = out[key]
            print(f"{key:20s} p50 {s['p50']:.2f} p99 {s['p99']:.2f} max {s['max']:.2f}")
        print(
            "gc over the whole run (training thread): generation -> [count, s]",
            out["gc_whole_run_training_thread"],
        )
        if out["auto_cadence_tail"]:
            print("auto: (cost fed ms, step-after excess ms, interval)", out["auto_cadence_tail"])
        print(
            f"fences with the copy still pending: {out['fences_with_copy_pending']}/{out['fences']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
