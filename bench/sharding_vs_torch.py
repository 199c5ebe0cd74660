"""Benchmark: our sharding engine's four strategies vs torch FSDP2 and torch DDP.

One invocation trains the same GPT (`daemon.gpt`, same seed, same data, same AdamW) on 2 gloo
ranks under each of: torch DDP, torch FSDP2 (`fully_shard` per Block, then the root), and our
`sharding.FullyShardedDataParallel` with `no_shard`, `optim`, `optim_grads` and
`optim_grads_params`. Each configuration runs in fresh spawned ranks (so peak RSS is its own),
does `--warmup` untimed steps, then `--steps` timed steps; with `--rounds` > 1 the
configurations are run round-robin and the timed steps pooled, which spreads out the effect
of other load on the machine.

Per configuration: median step time (each step's time is the slower rank's), median CPU
seconds per step (the whole rank process, gloo's threads included: a figure that other load on
a shared machine moves much less than wall time), global tokens/s, peak RSS per rank
(`VmHWM`), the peak above the RSS of the built-but-unwrapped model, and the last loss (every
run but the communication-free lower bound must agree). Ratios: ours ZeRO-3 / FSDP2 (step
time, peak RSS) and ours `no_shard` / DDP (step time). Targets: ZeRO-3 step time <= 0.9x
FSDP2, `no_shard` <= 1.05x DDP, ZeRO-3 peak RSS <= FSDP2. `--profile-dir` samples rank 0's
timed steps of every run with py-spy (collapsed stacks, for finding hot spots).

    .venv/bin/python bench/sharding_vs_torch.py            # table
    .venv/bin/python bench/sharding_vs_torch.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import _common
from _common import MIB, median, ratio

TORCH_RUNS = ("local", "ddp", "fsdp2")
OUR_RUNS = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ALL_RUNS = TORCH_RUNS + OUR_RUNS
PHASES = ("forward", "backward", "optimizer")
LABELS = {
    "local": "no communication (lower bound)",
    "ddp": "torch DDP",
    "fsdp2": "torch FSDP2 fully_shard",
    "no_shard": "ours no_shard",
    "optim": "ours optim (ZeRO-1)",
    "optim_grads": "ours optim_grads (ZeRO-2)",
    "optim_grads_params": "ours optim_grads_params (ZeRO-3)",
}


def _wrap(name: str, module: Any, lr: float, weight_decay: float) -> tuple[Any, Any, Any]:
    """Wrap `module` for run `name`; returns (model, optimizer, engine or None)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from daemon.gpt import Block

    if name == "local":
        # Each rank trains its own replica: the compute floor under the same CPU contention.
        return (
            module,
            torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay),
            None,
        )
    if name == "ddp":
        model = DistributedDataParallel(module)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay), None
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in module.blocks:
            fully_shard(block)
        fully_shard(module)
        return (
            module,
            torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay),
            None,
        )
    from sharding import FullyShardedDataParallel, ShardingConfig, Strategy

    try:
        strategy = Strategy(name)
    except ValueError:
        strategy = Strategy[name.upper()]
    config = ShardingConfig(strategy=strategy, unit_modules=(Block,), param_dtype=torch.float32)
    model = FullyShardedDataParallel(module, config)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=lr, weight_decay=weight_decay)
    return model, optimizer, model


def _start_py_spy(binary: str, out_dir: str, name: str) -> Any:
    """Sample this rank (native frames too) until `_stop_py_spy`; collapsed stacks out."""
    import subprocess

    out = Path(out_dir) / f"{name}-rank0.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            *(binary, "record", "--pid", str(os.getpid()), "--rate", "50", "--native", "--idle"),
            *("--format", "raw", "--output", str(out)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # let it attach before the timed steps start
    return proc


def _stop_py_spy(proc: Any) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def _engine_stats(engine: Any) -> dict[str, Any]:
    snap = engine.stats.snapshot()
    out = dataclasses.asdict(snap)
    out["collectives"] = {
        op: dataclasses.asdict(totals) if dataclasses.is_dataclass(totals) else totals
        for op, totals in snap.collectives.items()
    }
    return out


def _rank_main(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration on one rank: build, wrap, warm up, time; runs in a fresh process."""
    import torch
    import torch.distributed as dist

    from daemon.gpt import GPT, lm_loss

    _common.stdout_to_stderr()
    cfg = _common.tied_gpt_config(spec)
    torch.manual_seed(spec["seed"])
    module = GPT(cfg)
    num_params = sum(p.numel() for p in module.parameters())
    rss_built = _common.current_rss_bytes()
    peak_before_wrap = _common.peak_rss_bytes()
    reset_ok = _common.reset_peak_rss()

    model, optimizer, engine = _wrap(spec["name"], module, spec["lr"], spec["weight_decay"])

    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    num_steps = spec["warmup"] + spec["steps"]
    batches = torch.randint(
        0, cfg.vocab_size, (num_steps, spec["batch"], cfg.seq_len + 1), generator=gen
    )
    step_s: list[float] = []
    cpu_s: list[float] = []
    phase_s: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    losses: list[float] = []
    profiler = None
    for i in range(num_steps):
        if i == spec["warmup"]:
            dist.barrier()
            if rank == 0 and spec["py_spy"]:
                profiler = _start_py_spy(spec["py_spy"], spec["profile_dir"], spec["name"])
        x, y = batches[i, :, :-1], batches[i, :, 1:]
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        t3 = time.perf_counter()
        if i >= spec["warmup"]:
            step_s.append(t3 - t0)
            cpu_s.append(time.process_time() - c0)
            phase_s["forward"].append(t1 - t0)
            phase_s["backward"].append(t2 - t1)
            phase_s["optimizer"].append(t3 - t2)
    if profiler is not None:
        _stop_py_spy(profiler)
    peak_train = _common.peak_rss_bytes()
    return {
        "step_s": step_s,
        "cpu_s": cpu_s,
        "phase_s": phase_s,
        "losses": losses,
        "num_params": num_params,
        "rss_built_bytes": rss_built,
        "peak_rss_bytes": max(peak_before_wrap, peak_train),
        "train_peak_over_built_bytes": peak_train - rss_built if reset_ok else None,
        "engine_stats": _engine_stats(engine) if engine is not None else None,
    }


def _engine_available() -> str | None:
    """None if `sharding` exposes the contract API, else why not."""
    try:
        sharding = importlib.import_module("sharding")
    except Exception as err:
        return f"import sharding failed: {err!r}"
    missing = [
        n
        for n in ("FullyShardedDataParallel", "ShardingConfig", "Strategy")
        if n not in getattr(sharding, "__all__", ())
    ]
    return f"sharding.__all__ lacks {missing}" if missing else None


def _summarise(name: str, per_round: list[list[dict[str, Any]]], tokens: int) -> dict[str, Any]:
    step_times = [
        max(rank_steps)
        for ranks in per_round
        for rank_steps in zip(*(r["step_s"] for r in ranks), strict=True)
    ]
    med = median(step_times)
    # CPU seconds of the whole rank process (gloo's threads included) per step: less
    # sensitive than wall time to other load on a shared machine.
    cpu_times = [
        max(rank_cpu)
        for ranks in per_round
        for rank_cpu in zip(*(r["cpu_s"] for r in ranks), strict=True)
    ]
    world = len(per_round[0])
    peaks = [max(ranks[r]["peak_rss_bytes"] for ranks in per_round) for r in range(world)]
    deltas = [
        ranks[r]["train_peak_over_built_bytes"]
        for ranks in per_round
        for r in range(world)
        if ranks[r]["train_peak_over_built_bytes"] is not None
    ]
    last = per_round[-1]
    return {
        "label": LABELS[name],
        "median_step_s": med,
        "min_step_s": min(step_times),
        "max_step_s": max(step_times),
        "num_timed_steps": len(step_times),
        "median_cpu_s": median(cpu_times),
        "tokens_per_s": tokens / med,
        # Phases of rank 0 (with async collectives the split between them is approximate).
        "median_phase_s_rank0": {
            phase: median(t for ranks in per_round for t in ranks[0]["phase_s"][phase])
            for phase in PHASES
        },
        "peak_rss_bytes_per_rank": peaks,
        "peak_rss_bytes": max(peaks),
        "train_peak_over_built_bytes": max(deltas) if deltas else None,
        "losses_rank0": last[0]["losses"],
        "final_loss_per_rank": [r["losses"][-1] for r in last],
        "num_params": last[0]["num_params"],
        "engine_stats_rank0": last[0]["engine_stats"],
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per round (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="round-robin repetitions (default 1)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only",
        default=",".join(ALL_RUNS),
        help=f"comma-separated subset of {','.join(ALL_RUNS)}",
    )
    p.add_argument("--timeout-s", type=float, default=900.0, help="per configuration")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument(
        "--profile-dir",
        default=None,
        help="sample rank 0's timed steps of each run with py-spy into DIR/<run>-rank0.txt "
        "(collapsed stacks; needs py-spy on PATH or --py-spy; perturbs the timings)",
    )
    p.add_argument("--py-spy", default=None, help="path of the py-spy binary")
    args = p.parse_args(argv)
    if args.profile_dir is not None:
        args.py_spy = args.py_spy or shutil.which("py-spy")
        if args.py_spy is None:
            p.error("--profile-dir needs py-spy: pip install py-spy, or pass --py-spy PATH")
    unknown = set(args.only.split(",")) - set(ALL_RUNS)
    if unknown:
        p.error(f"--only: unknown runs {sorted(unknown)}; choose from {list(ALL_RUNS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table (or JSON)."""
    args = _parse_args(argv)
    runs = [r for r in ALL_RUNS if r in args.only.split(",")]
    skipped: dict[str, str] = {}
    why_not = _engine_available()
    if why_not is not None:
        for r in runs:
            if r in OUR_RUNS:
                skipped[r] = why_not
        runs = [r for r in runs if r not in OUR_RUNS]
    spec_base = {
        "layers": args.layers,
        "d_model": args.d_model,
        "heads": args.heads,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "py_spy": args.py_spy if args.profile_dir else None,
        "profile_dir": args.profile_dir,
    }
    conditions_before = _common.machine_conditions()
    raw: dict[str, list[list[dict[str, Any]]]] = {r: [] for r in runs}
    for rnd in range(args.rounds):
        for name in runs:
            if not args.json:
                print(f"[round {rnd + 1}/{args.rounds}] {LABELS[name]} ...", file=sys.stderr)
            try:
                raw[name].append(
                    _common.run_ranks(
                        _rank_main,
                        args.world_size,
                        {**spec_base, "name": name},
                        timeout_s=args.timeout_s,
                    )
                )
            except Exception as err:
                skipped[name] = f"{type(err).__name__}: {str(err)[-2000:]}"
                print(f"{LABELS[name]} failed: {skipped[name]}", file=sys.stderr)
    tokens = args.batch * args.seq_len * args.world_size
    results = {
        name: _summarise(name, per_round, tokens)
        for name, per_round in raw.items()
        if per_round and name not in skipped
    }

    def get(name: str, key: str) -> float | None:
        return results[name][key] if name in results else None

    report: dict[str, Any] = {
        "zero3_vs_fsdp2_step_time": ratio(
            get("optim_grads_params", "median_step_s"), get("fsdp2", "median_step_s")
        ),
        "noshard_vs_ddp_step_time": ratio(
            get("no_shard", "median_step_s"), get("ddp", "median_step_s")
        ),
        "zero3_vs_fsdp2_peak_rss": ratio(
            get("optim_grads_params", "peak_rss_bytes"), get("fsdp2", "peak_rss_bytes")
        ),
        "zero3_vs_fsdp2_cpu_time": ratio(
            get("optim_grads_params", "median_cpu_s"), get("fsdp2", "median_cpu_s")
        ),
        "noshard_vs_ddp_cpu_time": ratio(
            get("no_shard", "median_cpu_s"), get("ddp", "median_cpu_s")
        ),
        "targets": {
            "zero3_vs_fsdp2_step_time": ("<=", 0.9),
            "noshard_vs_ddp_step_time": ("<=", 1.05),
            "zero3_vs_fsdp2_peak_rss": ("<=", 1.0),
        },
        "config": {**spec_base, "rounds": args.rounds, "world_size": args.world_size},
        "conditions_before": conditions_before,
        "conditions_after": _common.machine_conditions(),
        "results": results,
        "skipped": skipped,
    }
    if args.json:
        _common.print_json(report)
        return 0
    print(_render(report))
    return 0


def _render(report: dict[str, Any]) -> str:
    results = report["results"]
    cfg = report["config"]
    rows = []
    for name in ALL_RUNS:
        if name not in results:
            continue
        r = results[name]
        rows.append(
            [
                r["label"],
                r["median_step_s"],
                r["median_cpu_s"],
                "/".join(f"{r['median_phase_s_rank0'][k]:.2f}" for k in PHASES),
                round(r["tokens_per_s"]),
                *(round(b / MIB) for b in r["peak_rss_bytes_per_rank"]),
                round(r["train_peak_over_built_bytes"] / MIB)
                if r["train_peak_over_built_bytes"] is not None
                else None,
                f"{r['final_loss_per_rank'][0]:.6f}",
            ]
        )
    world = cfg["world_size"]
    headers = [
        "run",
        "median step s",
        "CPU s/step",
        "fwd/bwd/opt s (r0)",
        "tokens/s",
        *(f"peak RSS r{r} MiB" for r in range(world)),
        "peak over built MiB",
        "last loss r0",
    ]
    lines = [
        f"GPT {cfg['layers']} blocks, d_model {cfg['d_model']}, {cfg['heads']} heads, "
        f"seq {cfg['seq_len']}, batch {cfg['batch']}/rank, {world} gloo ranks x 1 thread, "
        f"{cfg['warmup']} warmup + {cfg['steps']} timed steps x {cfg['rounds']} round(s), AdamW",
        "",
        _common.markdown_table(headers, rows),
        "",
    ]
    lines += _common.verdict_lines(report)
    lines += _common.diagnostic_lines(
        report, ("zero3_vs_fsdp2_cpu_time", "noshard_vs_ddp_cpu_time")
    )
    lines.append(_common.conditions_line(report["conditions_before"], report["conditions_after"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
