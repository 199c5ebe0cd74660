"""What one rank's restore costs before its first step, by source (issue 29: recovery).

Trains the recovery bench's `big` job (`bench/_recovery/job.py`: the default GPT plus a
ballast, `--state-mib` MiB of weights and AdamW moments, `no_shard`, one rank) for 3 steps with
the memory tier on (`memory_every 1`) or off (the durable root on local disk, `ckpt_every 3`),
then starts a fresh rank process on the same memory directory and root, as a restart does, and
times its `restore_or_initialize` (the restore template with its optimizer state, the
restore, the loads into model and optimizer): the part of a recovery that grows with the
state. `--rounds` pairs, memory and durable interleaved; median and range of each, and the
source each restore reported. `--profile` writes a cProfile of each restore next to
`--profile` (a path prefix).

To compare two trees run it from each (`PYTHONPATH` set to the tree, from that tree's
root); the command is the tree's own:

    .venv/bin/python bench/restore_cost.py --rounds 3
    .venv/bin/python bench/restore_cost.py --state-mib 512 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import statistics
import tempfile
import time
from typing import Any

import _common
from _recovery import job as bench_job

_TIERS = {"memory": "1", "durable": "0"}


def _rank(rank: int, world_size: int, root: str, memory_dir: str, args: dict[str, Any]) -> Any:
    import torch

    from daemon._config_load import load_config
    from daemon.jobs.job import JobContext
    from daemon.rank import loop
    from daemon.rank.telemetry import NullTelemetry
    from daemon.rundir.control import RankControl

    _common.stdout_to_stderr()
    os.environ[bench_job.STATE_MIB_ENV] = str(args["state_mib"])
    cfg = load_config(
        {
            "ckpt_uri": f"{root}/ckpt",
            "max_steps": str(3 if args["phase"] == "train" else 4),
            "ckpt_every": "3",
            "memory_every": _TIERS[args["tier"]],
            "memory_dir": memory_dir,
            "run_id": "restorecost",
            "device": "cpu",
            "strategy": "no_shard",
        },
        env={},
    )
    cfg.memory_tier_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    job = dataclasses.replace(
        bench_job.build(JobContext(rank=rank, world_size=world_size, seed=0)), sample=None
    )
    out: dict[str, Any] = {}
    if args["phase"] == "restore":
        timed = loop._Training.restore_or_initialize

        def restore(self: Any) -> None:
            profiler = cProfile.Profile() if args["profile"] else None
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.runcall(timed, self)
                profiler.dump_stats(f"{args['profile']}.{args['tier']}.{args['round']}")
            else:
                timed(self)
            out["seconds"] = time.perf_counter() - t0
            out["source"] = self.restore_source

        loop._Training.restore_or_initialize = restore  # type: ignore[method-assign]
    loop.run_training(
        cfg, job, telemetry=NullTelemetry(), control=RankControl(None, graceful_signals=False)
    )
    return out


def _one(tier: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        common = {"state_mib": args.state_mib, "tier": tier, "profile": args.profile}
        _common.run_ranks(_rank, 1, root, shm, {**common, "phase": "train"}, timeout_s=600)
        (result,) = _common.run_ranks(
            _rank, 1, root, shm, {**common, "phase": "restore", "round": round_}, timeout_s=600
        )
    return dict(result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="", help="path prefix for cProfile dumps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    before = _common.machine_conditions()
    samples: dict[str, list[dict[str, Any]]] = {tier: [] for tier in _TIERS}
    for round_ in range(args.rounds):
        for tier in _TIERS:
            samples[tier].append(_one(tier, round_, args))
    report: dict[str, Any] = {"args": vars(args), "machine_before": before}
    for tier, rows in samples.items():
        seconds = [r["seconds"] for r in rows]
        report[f"{tier}_restore_s"] = {
            "median": statistics.median(seconds),
            "min": min(seconds),
            "max": max(seconds),
            "samples": seconds,
            "sources": sorted({str(r["source"]) for r in rows}),
        }
    report["machine_after"] = _common.machine_conditions()
    if args.json:
        _common.print_json(report)
    else:
        for tier in _TIERS:
            r = report[f"{tier}_restore_s"]
            print(
                f"{tier:8s} restore_or_initialize {r['median']:.3f} s "
                f"[{r['min']:.3f}-{r['max']:.3f}] sources {r['sources']}"
            )
        print(_common.conditions_line(before, report["machine_after"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
