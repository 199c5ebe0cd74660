"""All-gather on gloo: torch's `all_gather_single` against the engine's exchange.

[Note: gloo all-gather] in `sharding/_comm.py`: on gloo the sharding engine gathers by
point-to-point exchange (each rank sends its shard to every other rank and receives theirs
straight into the output). This times both on `--ranks` fresh gloo ranks, per shard size,
interleaved (torch, ours, torch, ours, ...), `--repeats` each after a barrier; a sample is the
mean of enough back-to-back gathers to move 64 MiB (one for the largest), so that the
barrier's exit skew does not swamp a small gather; each sample is the slowest rank's. The
engine's gather is `Communicator.all_gather` over the default group, as `complete_replicated`
and the ZeRO-3 weight gathers call it.

    .venv/bin/python bench/gloo_gather.py --json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _common

SIZES_MIB = (0.25, 1.0, 4.0, 16.0, 64.0, 128.0)
"""Whole gathered tensor sizes (fp32), MiB."""


def _rank(rank: int, world: int, sizes_mib: list[float], repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from sharding._comm import Communicator
    from sharding._stats import ShardingStats

    comm = Communicator(None, torch.device("cpu"), ShardingStats(), None)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    out: dict[str, Any] = {}
    for mib in sizes_mib:
        n = int(mib * _common.MIB) // 4 // world
        output = torch.zeros(n * world)
        shard = torch.full((n,), float(rank))
        times: dict[str, list[float]] = {"torch": [], "ours": []}
        inner = max(1, int(64 / mib))
        for _ in range(repeats):
            for name in ("torch", "ours"):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    if name == "torch":
                        gather(output, shard)
                    else:
                        comm.all_gather(output, shard).wait()
                times[name].append((time.perf_counter() - t0) / inner)
                expected = torch.arange(world, dtype=torch.float32).repeat_interleave(n)
                if not torch.equal(output, expected):
                    raise RuntimeError(f"{name}: wrong gather of {mib} MiB")
                output.zero_()
        out[str(mib)] = times
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    before = _common.machine_conditions()
    results = _common.run_ranks(_rank, args.ranks, list(SIZES_MIB), args.repeats)
    rows, report = [], {}
    for mib in SIZES_MIB:
        key = str(mib)
        # Each repeat's time is the slowest rank's.
        slowest = {
            name: [max(r[key][name][i] for r in results) for i in range(args.repeats)]
            for name in ("torch", "ours")
        }
        torch_ms = statistics.median(slowest["torch"]) * 1e3
        ours_ms = statistics.median(slowest["ours"]) * 1e3
        ratios = [o / t for o, t in zip(slowest["ours"], slowest["torch"], strict=True)]
        report[key] = {
            "torch_ms": torch_ms,
            "ours_ms": ours_ms,
            "ours_vs_torch": statistics.median(ratios),
            "ours_vs_torch_range": [min(ratios), max(ratios)],
        }
        rows.append(
            [
                f"{mib:g}",
                f"{torch_ms:.2f}",
                f"{ours_ms:.2f}",
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            ]
        )
    after = _common.machine_conditions()
    if args.json:
        _common.print_json(
            {"ranks": args.ranks, "repeats": args.repeats, "sizes": report,
             "machine_before": before, "machine_after": after}
        )  # fmt: skip
        return 0
    print(
        _common.markdown_table(
            ["MiB gathered", "torch all_gather_single ms", "ours (exchange) ms", "ours / torch"],
            rows,
        )
    )
    print(_common.conditions_line(before, after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
