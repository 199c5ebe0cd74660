"""Benchmark: our sharding engine vs torch FSDP2 and torch DDP, at 2 and 4 ranks, fp32 and bf16.

One invocation trains the same GPT (`daemon.jobs.gpt`, same seed, same data, same AdamW) under
several configurations, each a set of runs in fresh spawned gloo ranks (so peak RSS is the
run's own):

- `2r_fp32`: 2 ranks, fp32: torch DDP, torch FSDP2, ours `no_shard` and ZeRO-3
  (`optim_grads_params`); `--runs-2r` adds `local` (no communication), `optim`, `optim_grads`;
- `4r_fp32`: 4 ranks, fp32: DDP, FSDP2, ours ZeRO-3;
- `2r_bf16`: 2 ranks, bf16 compute: FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`, ours ZeRO-3 with the same policy;
- `big_4r` (memory): 4 ranks, a model of `--big-d-model` (>= 50M parameters by default) with
  short sequences, so that parameters, gradients and AdamW state dominate: peak RSS per rank
  of DDP, FSDP2 (meta-device init: `fully_shard` on the meta model, `to_empty`, then init, as
  its docs recommend for large models) and ours ZeRO-3.

FSDP2 is configured as its docs recommend: `fully_shard` per Block then the root,
`reshard_after_forward=True`, its own implicit prefetching. Every run does `--warmup` untimed
steps, then `--steps` timed ones; rounds are interleaved: each of `--rounds` rounds runs every
(configuration, run) once, round-robin, so slow phases of other load hit every run alike.

Per run: median step time (each step's time is the slowest rank's), CPU seconds per step
(the rank process, gloo's threads included), tokens/s, peak RSS per rank (`VmHWM`), the
last losses. Each ratio is computed within a round (adjacent runs) and reported as median
and min-max over rounds. Targets (issue 20): ZeRO-3 step time <= 0.9x FSDP2 at 2 ranks fp32,
<= 0.95x at 4 ranks and in bf16; `no_shard` <= 1.05x DDP; on the big model ZeRO-3 peak RSS
<= 0.6x DDP and <= 1.0x FSDP2. `--profile-dir` samples rank 0's timed steps of every run
with py-spy (collapsed stacks, for finding hot spots).

    .venv/bin/python bench/sharding_vs_torch.py --json                  # all, 5 rounds
    .venv/bin/python bench/sharding_vs_torch.py --configs 2r_fp32 --rounds 3
    .venv/bin/python bench/sharding_vs_torch.py --smoke --json          # end-to-end check
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
from _common import MIB, median

TORCH_RUNS = ("local", "ddp", "fsdp2")
OUR_RUNS = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ALL_RUNS = TORCH_RUNS + OUR_RUNS
CONFIGS = ("2r_fp32", "4r_fp32", "2r_bf16", "big_4r")
# (key, configuration, numerator run, denominator run, measure); the measure is per round.
RATIOS = (
    ("zero3_vs_fsdp2_step_time", "2r_fp32", "optim_grads_params", "fsdp2", "median_step_s"),
    ("zero3_vs_fsdp2_step_time_4r", "4r_fp32", "optim_grads_params", "fsdp2", "median_step_s"),
    ("zero3_vs_fsdp2_step_time_bf16", "2r_bf16", "optim_grads_params", "fsdp2", "median_step_s"),
    ("noshard_vs_ddp_step_time", "2r_fp32", "no_shard", "ddp", "median_step_s"),
    ("zero3_vs_ddp_peak_rss_big", "big_4r", "optim_grads_params", "ddp", "peak_rss_bytes"),
    ("zero3_vs_fsdp2_peak_rss_big", "big_4r", "optim_grads_params", "fsdp2", "peak_rss_bytes"),
    # Diagnostics (no target).
    ("zero3_vs_fsdp2_cpu_time", "2r_fp32", "optim_grads_params", "fsdp2", "median_cpu_s"),
    ("zero3_vs_ddp_step_time_4r", "4r_fp32", "optim_grads_params", "ddp", "median_step_s"),
    ("zero3_vs_fsdp2_peak_rss", "2r_fp32", "optim_grads_params", "fsdp2", "peak_rss_bytes"),
)
TARGETS = {
    "zero3_vs_fsdp2_step_time": ("<=", 0.9),
    "zero3_vs_fsdp2_step_time_4r": ("<=", 0.95),
    "zero3_vs_fsdp2_step_time_bf16": ("<=", 0.95),
    "noshard_vs_ddp_step_time": ("<=", 1.05),
    "zero3_vs_ddp_peak_rss_big": ("<=", 0.6),
    "zero3_vs_fsdp2_peak_rss_big": ("<=", 1.0),
}
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


def _init_gpt(module: Any) -> None:
    """Initialise a GPT materialised from the meta device (`to_empty`): GPT's own init
    (`GPT._init_weights`, the scaled residual projections) plus LayerNorm's defaults."""
    import math

    import torch
    from torch import nn

    from daemon import GPT

    with torch.no_grad():
        module.apply(GPT._init_weights)
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm):
                sub.reset_parameters()
        for name, p in module.named_parameters():
            if name.endswith(("attn.proj.weight", "out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * module.cfg.num_layers))


def _wrap(
    name: str, module: Any, lr: float, weight_decay: float, spec: dict[str, Any]
) -> tuple[Any, Any, Any]:
    """Wrap `module` for run `name`; returns (model, optimizer, engine or None)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from daemon import Block

    bf16 = spec["dtype"] == "bf16"

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
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # As FSDP2's docs recommend: per block then the root, resharded after forward, its
        # own implicit prefetch; bf16 compute with fp32 gradient reduction.
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        for block in module.blocks:
            fully_shard(block, reshard_after_forward=True, mp_policy=mp)
        fully_shard(module, reshard_after_forward=True, mp_policy=mp)
        if spec["meta_init"]:
            module.to_empty(device="cpu")
            _init_gpt(module)
        return (
            module,
            torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay),
            None,
        )
    from sharding import DeferredInit, FullyShardedDataParallel, ShardingConfig, Strategy

    try:
        strategy = Strategy(name)
    except ValueError:
        strategy = Strategy[name.upper()]
    config = ShardingConfig(
        strategy=strategy,
        unit_modules=(Block,),
        param_dtype=torch.bfloat16 if bf16 else torch.float32,
        deferred_init=DeferredInit(seed=spec["seed"], init_fn=module.init_weights),
    )
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

    from daemon import GPT, lm_loss

    _common.stdout_to_stderr()
    cfg = _common.tied_gpt_config(spec)
    torch.manual_seed(spec["seed"])
    # Meta-device init for the sharded runs (FSDP2's recipe; our deferred init, which
    # materializes one unit at a time); DDP and the local floor need the whole model anyway.
    sharded = spec["name"] not in ("ddp", "local")
    spec = {**spec, "meta_init": spec["meta_init"] and sharded}
    with torch.device("meta" if spec["meta_init"] else "cpu"):
        module = GPT(cfg)
    num_params = sum(p.numel() for p in module.parameters())
    rss_built = _common.current_rss_bytes()
    peak_before_wrap = _common.peak_rss_bytes()
    reset_ok = _common.reset_peak_rss()

    model, optimizer, engine = _wrap(spec["name"], module, spec["lr"], spec["weight_decay"], spec)

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


def _summarise(name: str, ranks: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """One run (one round) of one configuration: step time of the slowest rank, etc."""
    step_times = [max(steps) for steps in zip(*(r["step_s"] for r in ranks), strict=True)]
    cpu_times = [max(cpu) for cpu in zip(*(r["cpu_s"] for r in ranks), strict=True)]
    med = median(step_times)
    peaks = [r["peak_rss_bytes"] for r in ranks]
    deltas = [
        r["train_peak_over_built_bytes"]
        for r in ranks
        if r["train_peak_over_built_bytes"] is not None
    ]
    return {
        "label": LABELS[name],
        "median_step_s": med,
        "min_step_s": min(step_times),
        "max_step_s": max(step_times),
        "num_timed_steps": len(step_times),
        "median_cpu_s": median(cpu_times),
        "tokens_per_s": tokens / med,
        # Phases of rank 0 (with async collectives the split between them is approximate).
        "median_phase_s_rank0": {phase: median(ranks[0]["phase_s"][phase]) for phase in PHASES},
        "peak_rss_bytes_per_rank": peaks,
        "peak_rss_bytes": max(peaks),
        "train_peak_over_built_bytes": max(deltas) if deltas else None,
        "losses_rank0": ranks[0]["losses"],
        "final_loss_per_rank": [r["losses"][-1] for r in ranks],
        "num_params": ranks[0]["num_params"],
        "engine_stats_rank0": ranks[0]["engine_stats"],
    }


def _spread(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def _pooled(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's figures over all its rounds (median/min-max of the per-round figures)."""
    out: dict[str, Any] = {
        "label": per_round[0]["label"],
        "num_params": per_round[0]["num_params"],
        "rounds": len(per_round),
        "peak_rss_bytes_per_rank": [
            max(r["peak_rss_bytes_per_rank"][k] for r in per_round)
            for k in range(len(per_round[0]["peak_rss_bytes_per_rank"]))
        ],
        "final_loss_per_rank": per_round[-1]["final_loss_per_rank"],
        "median_phase_s_rank0": per_round[-1]["median_phase_s_rank0"],
        "per_round": per_round,
    }
    for key in ("median_step_s", "median_cpu_s", "tokens_per_s", "peak_rss_bytes"):
        out[key] = _spread([r[key] for r in per_round])
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)}",
    )
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument(
        "--runs-2r",
        default="ddp,fsdp2,no_shard,optim_grads_params",
        help=f"runs of the 2r_fp32 configuration, a subset of {','.join(ALL_RUNS)}",
    )
    p.add_argument(
        "--big-d-model", type=int, default=1024, help="big_4r width (default 1024: 51M params)"
    )
    p.add_argument("--big-seq-len", type=int, default=32, help="big_4r sequence (default 32)")
    p.add_argument("--big-rounds", type=int, default=1, help="rounds of big_4r (default 1)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models, 1 round, 1 timed step: checks the script end to end",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="sample rank 0's timed steps of each run with py-spy into DIR/<run>-rank0.txt "
        "(collapsed stacks; needs py-spy on PATH or --py-spy; perturbs the timings)",
    )
    p.add_argument("--py-spy", default=None, help="path of the py-spy binary")
    args = p.parse_args(argv)
    if args.smoke:
        args.d_model, args.heads, args.seq_len, args.batch = 64, 2, 16, 1
        args.warmup, args.steps, args.rounds, args.big_rounds = 1, 1, 1, 1
        args.big_d_model, args.big_seq_len = 64, 8
    if args.profile_dir is not None:
        args.py_spy = args.py_spy or shutil.which("py-spy")
        if args.py_spy is None:
            p.error("--profile-dir needs py-spy: pip install py-spy, or pass --py-spy PATH")
    unknown = set(args.runs_2r.split(",")) - set(ALL_RUNS)
    if unknown:
        p.error(f"--runs-2r: unknown runs {sorted(unknown)}; choose from {list(ALL_RUNS)}")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    if min(args.rounds, args.big_rounds, args.steps) < 1 or args.warmup < 0:
        p.error("--rounds, --big-rounds and --steps must be >= 1, --warmup >= 0")
    return args


def _plan(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every selected configuration: its ranks, runs, model and rounds."""
    step_model = {
        "layers": args.layers,
        "d_model": args.d_model,
        "heads": args.heads,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    plan = {
        "2r_fp32": {
            "world": 2,
            "dtype": "fp32",
            "runs": [r for r in ALL_RUNS if r in args.runs_2r.split(",")],
            **step_model,
        },
        "4r_fp32": {
            "world": 4,
            "dtype": "fp32",
            "runs": ["ddp", "fsdp2", "optim_grads_params"],
            **step_model,
        },
        "2r_bf16": {
            "world": 2,
            "dtype": "bf16",
            "runs": ["fsdp2", "optim_grads_params"],
            **step_model,
        },
        "big_4r": {
            "world": 4,
            "dtype": "fp32",
            "runs": ["ddp", "fsdp2", "optim_grads_params"],
            "layers": args.layers,
            "d_model": args.big_d_model,
            "heads": max(1, args.big_d_model // 64),
            "seq_len": args.big_seq_len,
            "batch": 1,
            # One optimizer step creates the AdamW state; the second is the steady peak.
            "warmup": 1,
            "steps": 1,
            "meta_init": True,
            "rounds": args.big_rounds,
        },
    }
    return {name: plan[name] for name in CONFIGS if name in args.configs.split(",")}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table (or JSON)."""
    args = _parse_args(argv)
    plan = _plan(args)
    skipped: dict[str, str] = {}
    why_not = _engine_available()
    if why_not is not None:
        for name, config in plan.items():
            for r in config["runs"]:
                if r in OUR_RUNS:
                    skipped[f"{name}/{r}"] = why_not
            config["runs"] = [r for r in config["runs"] if r not in OUR_RUNS]
    common = {
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "py_spy": args.py_spy if args.profile_dir else None,
        "profile_dir": args.profile_dir,
    }
    conditions_before = _common.machine_conditions()
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {r: [] for r in config["runs"]} for name, config in plan.items()
    }
    for rnd in range(args.rounds):
        for name, config in plan.items():
            if rnd >= config.get("rounds", args.rounds):
                continue
            tokens = config["batch"] * config["seq_len"] * config["world"]
            for run in config["runs"]:
                key = f"{name}/{run}"
                if key in skipped:
                    continue
                if not args.json:
                    print(
                        f"[round {rnd + 1}/{args.rounds}] {name} {LABELS[run]} ...", file=sys.stderr
                    )
                spec = {"meta_init": False, **config, **common, "name": run}
                try:
                    ranks = _common.run_ranks(
                        _rank_main, config["world"], spec, timeout_s=args.timeout_s
                    )
                except Exception as err:
                    skipped[key] = f"{type(err).__name__}: {str(err)[-2000:]}"
                    print(f"{key} failed: {skipped[key]}", file=sys.stderr)
                    continue
                raw[name][run].append(_summarise(run, ranks, tokens))
    report = _report(args, plan, raw, skipped, conditions_before)
    if args.json:
        _common.print_json(report)
        return 0
    print(_render(report))
    return 0


def _report(
    args: argparse.Namespace,
    plan: dict[str, dict[str, Any]],
    raw: dict[str, dict[str, list[dict[str, Any]]]],
    skipped: dict[str, str],
    conditions_before: dict[str, Any],
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for key, config, num, den, measure in RATIOS:
        a, b = raw.get(config, {}).get(num, []), raw.get(config, {}).get(den, [])
        # Paired within a round: the two runs were adjacent in time.
        report[key] = _spread(
            [x[measure] / y[measure] for x, y in zip(a, b, strict=False) if y[measure]]
        )
    report.update(
        targets={k: v for k, v in TARGETS.items()},
        config={
            **{k: v for k, v in vars(args).items() if k != "json"},
            "plan": {n: {k: v for k, v in c.items()} for n, c in plan.items()},
        },
        conditions_before=conditions_before,
        conditions_after=_common.machine_conditions(),
        results={
            name: {run: _pooled(rounds) for run, rounds in runs.items() if rounds}
            for name, runs in raw.items()
        },
        skipped=skipped,
    )
    return report


def _render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    plan = report["config"]["plan"]

    def cell(spread: dict[str, Any] | None, scale: float = 1.0, fmt: str = ".3f") -> str:
        if spread is None:
            return "n/a"
        lo, mid, hi = (spread[k] / scale for k in ("min", "median", "max"))
        return f"{mid:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"

    for name, runs in report["results"].items():
        c = plan[name]
        lines.append(
            f"{name}: GPT {c['layers']} blocks, d_model {c['d_model']}, seq {c['seq_len']}, "
            f"batch {c['batch']}/rank, {c['world']} gloo ranks, {c['dtype']}, "
            f"{c['warmup']} warmup + {c['steps']} timed steps, "
            f"{next(iter(runs.values()))['num_params'] / 1e6:.1f}M params"
        )
        rows = [
            [
                r["label"],
                cell(r["median_step_s"]),
                cell(r["median_cpu_s"]),
                cell(r["peak_rss_bytes"], MIB, ".0f"),
                "/".join(f"{b / MIB:.0f}" for b in r["peak_rss_bytes_per_rank"]),
                f"{r['final_loss_per_rank'][0]:.6f}",
            ]
            for r in runs.values()
        ]
        headers = [
            "run (median, min-max over rounds)",
            "step s",
            "CPU s/step",
            "peak RSS MiB (max rank)",
            "peak RSS per rank MiB",
            "last loss r0",
        ]
        lines += [_common.markdown_table(headers, rows), ""]
    for key, *_ in RATIOS:
        lines.append(f"{key}: {cell(report.get(key))}")
    lines += _common.verdict_lines(report)
    lines.append(_common.conditions_line(report["conditions_before"], report["conditions_after"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
