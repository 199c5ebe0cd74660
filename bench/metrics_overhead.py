"""Cost of trainingd's metrics on the training step: exporter on vs off, in one run.

One rank (gloo, world size 1) trains the default job's GPT through the sharding engine
(`--strategy`, default ZeRO-3). Steps run in interleaved blocks, alternately with the exporter
off (no recording, no observer) and on (everything the training loop records per step, the
engine's collective observer, a snapshot file published every 0.5 s, and a separate scraper
process that runs the node collector and renders `/metrics` every `--scrape-interval` seconds,
1 s by default: 15x Prometheus' usual rate). Interleaving cancels drift (thermal, other load);
the result is the ratio of median step times, on / off.

    .venv/bin/python bench/metrics_overhead.py --steps-per-block 20 --blocks 10

Prints one JSON line: {"off_step_s": ..., "on_step_s": ..., "ratio": ..., ...}, plus the
median time of the per-step recording itself (`bookkeeping_s_per_step`), timed inline, which
stays meaningful when other load makes the on/off ratio noisy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _scraper(run_dir: str, interval_s: float, stop: Any) -> None:
    from prometheus_client import generate_latest

    from daemon.observe.collector import NodeCollector, SnapshotAggregator, make_registry
    from daemon.observe.state import NodeState

    state = NodeState(local_ranks=1)
    registry = make_registry(
        NodeCollector(
            SnapshotAggregator(Path(run_dir), 1), state, {"version": "bench"}, run_id="bench"
        )
    )
    while not stop.wait(interval_s):
        generate_latest(registry)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its JSON result line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10, help="blocks (half on, half off)")
    parser.add_argument("--steps-per-block", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from daemon.jobs.default_job import build
    from daemon.jobs.job import JobContext
    from daemon.rank.data import ShardedLoader
    from daemon.rank.telemetry import RankTelemetry
    from daemon.rundir.snapshot import snapshot_path
    from sharding import DeferredInit, FullyShardedDataParallel, ShardingConfig, Strategy

    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    job = build(JobContext(rank=0, world_size=1, seed=0))
    run_dir = Path(tempfile.mkdtemp(prefix="trainingd-bench-"))
    telemetry = RankTelemetry(snapshot_path(run_dir, 0), rank=0, world_size=1)
    observer = _Switch()
    model = FullyShardedDataParallel(
        job.model,
        ShardingConfig(
            strategy=Strategy(args.strategy),
            unit_modules=job.unit_modules,
            deferred_init=DeferredInit(seed=0, init_fn=job.init_fn),
        ),
        observer=observer,
    )
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    loader = ShardedLoader(job.train_data, batch_size=args.batch_size, rank=0, world_size=1, seed=0)
    stop = mp.get_context("spawn").Event()
    scraper = mp.get_context("spawn").Process(
        target=_scraper, args=(str(run_dir), args.scrape_interval, stop), daemon=True
    )
    scraper.start()

    bookkeeping: list[float] = []

    def step(on: bool) -> float:
        t0 = time.perf_counter()
        inputs, targets = loader.next_batch()
        data_s = time.perf_counter() - t0
        loss = job.loss_fn(model(inputs), targets)
        loss.backward()
        grad_norm = optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        agreed = torch.tensor([float(loss.detach()), 0.0, 0.0])
        dist.all_reduce(agreed)
        if on:
            t1 = time.perf_counter()
            step_s = t1 - t0
            telemetry.inc("trainingd_train_steps_total")
            telemetry.set("trainingd_train_step", 1)
            telemetry.observe("trainingd_train_step_duration_seconds", step_s)
            telemetry.observe("trainingd_train_data_loading_seconds", data_s)
            telemetry.inc("trainingd_train_tokens_total", inputs.numel())
            telemetry.set("trainingd_train_loss", float(agreed[0]))
            telemetry.set("trainingd_train_grad_norm", float(grad_norm))
            telemetry.set("trainingd_train_learning_rate", 1e-3)
            telemetry.update_sharding(model.stats.snapshot())
            telemetry.heartbeat()
            bookkeeping.append(time.perf_counter() - t1)
        return time.perf_counter() - t0

    for _ in range(args.warmup_steps):
        step(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(args.blocks):
        on = block % 2 == 1
        observer.target = telemetry if on else None
        times[on].extend(step(on) for _ in range(args.steps_per_block))
    stop.set()
    scraper.join(timeout=10)
    dist.destroy_process_group()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    result = {
        "bench": "metrics_overhead",
        "strategy": args.strategy,
        "steps_each": len(times[True]),
        "off_step_s": round(off, 5),
        "on_step_s": round(on, 5),
        "ratio": round(on / off, 4),
        # Direct measure, robust to a noisy machine: the loop's per-step recording and
        # publishing, timed inline (the scraper runs in another process).
        "bookkeeping_s_per_step": round(statistics.median(bookkeeping), 7),
        "bookkeeping_share": round(statistics.median(bookkeeping) / off, 6),
        "overhead_pct": round(100 * (on / off - 1), 2),
        "scrape_interval_s": args.scrape_interval,
        "torch": torch.__version__,
        "threads": args.threads,
    }
    print(json.dumps(result))
    return 0


class _Switch:
    """The engine's collective observer, forwarding to the telemetry only while 'on'."""

    def __init__(self) -> None:
        self.target: Any = None

    def on_collective(self, op: str, num_bytes: int, seconds: float) -> None:
        if self.target is not None:
            self.target.on_collective(op, num_bytes, seconds)


if __name__ == "__main__":
    sys.exit(main())
