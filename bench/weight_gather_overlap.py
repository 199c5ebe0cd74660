"""Benchmark: ZeRO-1/2 post-step weight all-gathers waited in `step()` vs overlapped with forward.

Since issue 17, `DistributedOptimizer.step()` under `optim` / `optim_grads` leaves the weight
all-gathers pending and each unit's pre-forward of the next forward waits on its own
([Note: deferred weight gather] in `sharding/_optimizer.py`). The old behaviour is the same
training with `model.wait_pending_weights()` called right after `step()`, so both run in the
same ranks on the same model: blocks of `--block` steps alternate between the two modes
(`--rounds` times), the first step of each block is dropped (it pays or skips the previous
block's wait), and each step's time is the slower rank's.

Per strategy: median step time in each mode, their ratio (deferred / waited in step; below 1
is the gain), and the median host time per step spent waiting on all-gathers (the exposed
communication, from the engine's stats). Nothing is asserted: figures move with load.

    .venv/bin/python bench/weight_gather_overlap.py            # table
    .venv/bin/python bench/weight_gather_overlap.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common
from _common import median, ratio

STRATEGIES = ("optim", "optim_grads")
MODES = ("waited_in_step", "deferred")


def _rank_main(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train one strategy, alternating the two modes in blocks; per-step times by mode."""
    import torch
    import torch.distributed as dist

    from daemon import GPT, Block, lm_loss
    from sharding import FullyShardedDataParallel, ShardingConfig, Strategy

    _common.stdout_to_stderr()
    cfg = _common.tied_gpt_config(spec)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        GPT(cfg), ShardingConfig(strategy=Strategy(spec["strategy"]), unit_modules=(Block,))
    )
    opt = model.make_optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)

    def one_step(mode: str) -> tuple[float, float]:
        batch = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.seq_len + 1), generator=gen)
        waited = model.stats.snapshot().collectives["all_gather"].seconds
        t0 = time.perf_counter()
        lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
        if mode == "waited_in_step":
            model.wait_pending_weights()  # main's behaviour before issue 17
        opt.zero_grad()
        seconds = time.perf_counter() - t0
        return seconds, model.stats.snapshot().collectives["all_gather"].seconds - waited

    for _ in range(spec["warmup"]):
        one_step("deferred")
    dist.barrier()
    out: dict[str, dict[str, list[float]]] = {m: {"step_s": [], "wait_s": []} for m in MODES}
    for _ in range(spec["rounds"]):
        for mode in MODES:
            for i in range(spec["block"]):
                step_s, wait_s = one_step(mode)
                if i > 0:
                    out[mode]["step_s"].append(step_s)
                    out[mode]["wait_s"].append(wait_s)
    model.wait_pending_weights()
    return out


def _summarise(per_rank: list[dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for mode in MODES:
        steps = [max(vals) for vals in zip(*(r[mode]["step_s"] for r in per_rank), strict=True)]
        waits = [max(vals) for vals in zip(*(r[mode]["wait_s"] for r in per_rank), strict=True)]
        result[mode] = {
            "median_step_s": median(steps),
            "median_allgather_wait_s": median(waits),
            "num_steps": len(steps),
        }
    result["step_ratio_deferred_over_waited"] = ratio(
        result["deferred"]["median_step_s"], result["waited_in_step"]["median_step_s"]
    )
    return result


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    p.add_argument("--block", type=int, default=4, help="steps per mode block (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="blocks per mode (default 3)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per strategy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if args.block < 2:
        p.error("--block must be at least 2 (the first step of each block is dropped)")
    if args.rounds < 1 or args.world_size < 2:
        p.error("--rounds must be >= 1 and --world-size >= 2 (one rank gathers nothing)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both strategies and print the table (or JSON)."""
    args = _parse_args(argv)
    before = _common.machine_conditions()
    report: dict[str, Any] = {"args": vars(args), "strategies": {}}
    for strategy in STRATEGIES:
        spec = {**vars(args), "strategy": strategy}
        per_rank = _common.run_ranks(_rank_main, args.world_size, spec, timeout_s=args.timeout_s)
        report["strategies"][strategy] = _summarise(per_rank)
    after = _common.machine_conditions()
    report["conditions"] = {"before": before, "after": after}
    if args.json:
        _common.print_json(report)
        return 0
    rows = []
    for strategy, res in report["strategies"].items():
        rows.append(
            [
                strategy,
                res["waited_in_step"]["median_step_s"],
                res["deferred"]["median_step_s"],
                res["step_ratio_deferred_over_waited"],
                res["waited_in_step"]["median_allgather_wait_s"],
                res["deferred"]["median_allgather_wait_s"],
                res["deferred"]["num_steps"],
            ]
        )
    print(
        _common.markdown_table(
            [
                "strategy",
                "step s (waited in step)",
                "step s (deferred)",
                "ratio deferred / waited",
                "all-gather wait s/step (waited)",
                "all-gather wait s/step (deferred)",
                "steps per mode",
            ],
            rows,
        )
    )
    print(_common.conditions_line(before, after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
