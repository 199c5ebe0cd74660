"""What a memory snapshot adds to the step, per `[checkpoint] staging_nice` (issue 29).

`bench/recovery.py`'s step rounds (no kill: the daemons on one node x 2 ranks train the bench's
job and the ranks' step times are read from outside, `bench/_recovery/rounds.py`) with the
tier off and, for each `--nice` value, at `memory_every 1` and `auto`, interleaved over
`--repeats` passes (the order reversed every other pass) so that a drift of the machine falls
on every arm alike ([Note: the staging thread yields to training] in
`ckpt_manager/_save/staging.py`). Per pass, each arm's median step against the off arm's
of the same pass: the extra milliseconds, and the same in memcpys of the rank's state
(timed with the rank's threads: [Note: a memcpy of the rank's state is the rank's own] in
`_recovery/machine.py`); the snapshots' stall (`trainingd_memory_snapshot_seconds`) as the
share of them within 5 ms and its p99, interpolated in the histogram's buckets.

    .venv/bin/python bench/staging_nice.py                          # 256 MiB job, nice 0 / 10
    .venv/bin/python bench/staging_nice.py --nice 0 5 10 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import MIB, machine_conditions, markdown_table, print_json
from _recovery import machine, rounds, stats

_FIVE_MS = 0.005


def _arms(nices: list[int]) -> list[tuple[str, int | None]]:
    """(memory_every, staging_nice) of every arm, the off arm first."""
    return [("0", None)] + [(m, n) for m in ("1", "auto") for n in nices]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nice", type=int, nargs="+", default=[0, 10], help="values compared")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes")
    parser.add_argument("--measure-steps", type=int, default=60, help="steps timed per round")
    parser.add_argument("--state-mib", type=int, default=256, help="state per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if any(not 0 <= n <= 19 for n in args.nice):
        parser.error("--nice: each between 0 and 19 (staging_nice's range)")
    before = machine_conditions()
    rng = random.Random(args.seed)
    arms = _arms(args.nice)
    passes: list[dict[str, Any]] = []
    state = 0
    with tempfile.TemporaryDirectory(prefix="staging-nice-") as tmp:
        for repeat in range(args.repeats):
            order = arms if repeat % 2 == 0 else list(reversed(arms))
            medians: dict[str, float] = {}
            buckets: dict[str, dict[str, float]] = {}
            for memory_every, nice in order:
                name = f"mem{memory_every}" + ("" if nice is None else f"-nice{nice}")
                spec = rounds.RoundSpec(
                    topology="1x2", job_name="big", memory_every=memory_every, failure="rank",
                    kills=0, measure_steps=args.measure_steps, state_mib=args.state_mib,
                    ckpt_every=0, seed=args.seed, repeat=repeat, staging_nice=nice,
                )  # fmt: skip
                workdir = Path(tmp) / f"{repeat}-{name}"
                workdir.mkdir()
                t0 = time.monotonic()
                result = rounds.run_round(spec, workdir, rng, None)
                medians[name] = statistics.median(result["step_times_s"])
                buckets[name] = result.get("snapshot_seconds_buckets") or {}
                state = max(state, result.get("state_bytes_per_rank", 0))
                print(
                    f"pass {repeat} {name}: median step {medians[name] * 1e3:.1f} ms "
                    f"({time.monotonic() - t0:.0f} s)",
                    file=sys.stderr,
                )
            passes.append({"median_step_s": medians, "stall_buckets": buckets})
    memcpy_s = state / machine.memcpy_bytes_per_s(max(state, 256 * MIB))
    report = _report(passes, args.nice, memcpy_s)
    report.update(
        state_bytes_per_rank=state, memcpy_s=memcpy_s, passes=passes, args=vars(args),
        machine_before=before, machine_after=machine_conditions(),
    )  # fmt: skip
    if args.json:
        print_json(report)
        return 0
    rows = []
    for name, row in report["per_arm"].items():
        extra = row["extra_ms"]
        rows.append([
            name, f"{extra['median']:.1f} ({extra['min']:.1f}-{extra['max']:.1f})",
            f"{row['extra_memcpys']['median']:.2f}",
            f"{row['stall_within_5ms']:.3f}", f"{row['stall_p99_ms']:.2f}",
        ])  # fmt: skip
    header = ["arm", "extra ms per step, median (min-max)", "in memcpys", "stall <= 5 ms"]
    print(markdown_table([*header, "stall p99 ms"], rows))
    return 0


def _report(passes: list[dict[str, Any]], nices: list[int], memcpy_s: float) -> dict[str, Any]:
    """Per arm: extra step time against the same pass's off arm, and the stall's buckets."""
    per_arm: dict[str, Any] = {}
    for memory_every, nice in _arms(nices)[1:]:
        name = f"mem{memory_every}-nice{nice}"
        extra = [p["median_step_s"][name] - p["median_step_s"]["mem0"] for p in passes]
        merged = stats.merge_histograms(p["stall_buckets"].get(name, {}) for p in passes)
        total = merged.get(float("inf"), 0.0)
        p99 = stats.percentile_from_histogram(merged, 0.99)
        per_arm[name] = {
            "extra_ms": stats.spread([e * 1e3 for e in extra]),
            "extra_memcpys": stats.spread([e / memcpy_s for e in extra]),
            "snapshots": total,
            "stall_within_5ms": merged.get(_FIVE_MS, 0.0) / total if total else 0.0,
            "stall_p99_ms": p99 * 1e3 if p99 is not None else 0.0,
        }
    return {"per_arm": per_arm}


if __name__ == "__main__":
    sys.exit(main())
