"""Detection of hangs and stragglers: how fast, how wrong, how costly.

Issue 30. Four runs of `trainingd run` with the default job on 2 local ranks (CPU, gloo):

1. a clean run of `--steps` steps (2000 by default): `false_positives_clean_run` counts the
   `rank_straggler` and `rank_hung` lines it logged (must be 0); its step time is the
   "detection on" figure;
2. `--overhead-rounds` pairs of shorter runs (`--overhead-steps` each), detection on and off
   (`--straggler-window-steps 0`: the per-step exchange off), the order alternating from
   round to round so a drifting load cancels: `detection_overhead` is the median of the
   rounds' on / off ratios of mean step time (rank 0's `step` lines, the first 20 steps left
   out), with their min and max (`detection_overhead_range`: the spread is this machine's
   noise), <= 1.01 wanted;
3. rank 1 slowed from step 40 (`tests/daemon/_slow_rank_job.py`: it sleeps 3x a normal
   micro-batch's time in its loss), default straggler settings: `straggler_detect_s` is the
   time from the end of step 40 (rank 0's line) to the daemon's `rank_straggler` line;
4. a rank SIGSTOPped once training (`--hang-timeout-s 5`): `hang_detect_s` is the time from the
   stop to the `rank_hung` line, less the timeout; `hang_recovery_s` the time from the stop to
   the restarted group training again (both ranks' `training` lines of the new incarnation).

    .venv/bin/python bench/detection.py --json           # one JSON object (about 15 min)
    .venv/bin/python bench/detection.py --quick --json   # 200 steps: a smoke run
    .venv/bin/python bench/detection.py --parts overhead --json   # only the on/off pairs

The step times move with the machine's load; the report states it (`machine_before/after`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, machine_conditions, markdown_table, median, print_json

sys.path.insert(0, str(REPO_ROOT))

from tests.daemon import _slow_rank_job
from tests.daemon._daemon_proc import DaemonProc, wait_for

_ARGS = ["--nproc-per-node", "2", "--ckpt-every", "0", "--final-scrape-wait-s", "0"]
_HANG_TIMEOUT_S = 5.0
_SLOW_FROM_STEP = 40
_SKIP_STEPS = 20
_TIMEOUT_S = 3600.0


def _unix_s(event: dict[str, Any]) -> float:
    stamp = str(event["timestamp"]).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _mean_step_s(d: DaemonProc) -> float:
    """Mean step time from rank 0's `step` lines (every 10 steps), the first ones left out."""
    lines = [e for e in d.find("step") if e.get("rank") == 0 and e["step"] >= _SKIP_STEPS]
    first, last = lines[0], lines[-1]
    return (_unix_s(last) - _unix_s(first)) / (last["step"] - first["step"])


def _clean(workdir: Path, steps: int, name: str, extra: list[str]) -> tuple[float, int]:
    """(mean step seconds, false positives) of a clean run."""
    args = [*_ARGS, "--max-steps", str(steps), "--ckpt-uri", str(workdir / f"ckpt-{name}")]
    d = DaemonProc(workdir, [*args, *extra], name=name)
    try:
        code = d.wait(_TIMEOUT_S)
        assert code == 0, d.logs()
        false = len(d.find("rank_straggler")) + len(d.find("rank_hung"))
        return _mean_step_s(d), false
    finally:
        d.cleanup()


def _straggler(workdir: Path) -> float:
    env = {
        _slow_rank_job.SLOW_RANK_ENV: "1",
        _slow_rank_job.SLOW_FROM_ENV: str(_SLOW_FROM_STEP),
        _slow_rank_job.SLOW_UNTIL_ENV: "1000000",
        _slow_rank_job.SLOW_FACTOR_ENV: "3",
    }
    args = [*_ARGS, "--max-steps", "100000", "--ckpt-uri", str(workdir / "ckpt-slow")]
    args += ["--job", "tests.daemon._slow_rank_job:build"]
    d = DaemonProc(workdir, args, env=env, name="slow")
    try:
        named = wait_for(lambda: d.find("rank_straggler"), 600, "rank_straggler")
        (start,) = [e for e in d.find("step") if e.get("step") == _SLOW_FROM_STEP]
        assert named[0]["rank"] == 1, d.logs()
        d.signal(signal.SIGTERM)
        d.wait(120)
        return _unix_s(named[0]) - _unix_s(start)
    finally:
        d.cleanup()


def _training_again(d: DaemonProc) -> float | None:
    events = [e for e in d.find("training") if int(e.get("restart", 0)) >= 1]
    ranks = {int(e["local_rank"]): _unix_s(e) for e in events}
    return max(ranks.values()) if len(ranks) == 2 else None


def _hang(workdir: Path) -> tuple[float, float]:
    args = [*_ARGS, "--max-steps", "100000", "--ckpt-uri", str(workdir / "ckpt-hang")]
    args += ["--hang-timeout-s", str(_HANG_TIMEOUT_S), "--ckpt-every", "20"]
    d = DaemonProc(workdir, args, name="hang")
    try:
        wait_for(lambda: [e for e in d.find("step") if e["step"] >= 30], 600, "step 30")
        stopped = time.time()
        os.kill(d.rank_pids()[0], signal.SIGSTOP)
        hung = wait_for(lambda: d.find("rank_hung"), 120, "rank_hung")
        again = wait_for(lambda: _training_again(d), 600, "training again")
        d.signal(signal.SIGTERM)
        d.wait(120)
        return _unix_s(hung[0]) - stopped - _HANG_TIMEOUT_S, again - stopped
    finally:
        d.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps of the clean runs")
    parser.add_argument("--quick", action="store_true", help="200-step clean runs (a smoke run)")
    parser.add_argument("--overhead-rounds", type=int, default=5, help="on/off pairs")
    parser.add_argument("--overhead-steps", type=int, default=300, help="steps of each pair's runs")
    parser.add_argument(
        "--parts",
        default="clean,overhead,straggler,hang",
        help="which runs, comma-separated (default: all four)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"clean", "overhead", "straggler", "hang"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)} (use clean, overhead, straggler, hang)")
    steps = 200 if args.quick else args.steps
    if args.quick:
        args.overhead_rounds, args.overhead_steps = 1, 100
    before = machine_conditions()
    report: dict[str, Any] = {"steps": steps}
    with tempfile.TemporaryDirectory(prefix="detection-") as tmp:
        workdir = Path(tmp)
        if "clean" in parts:
            on_s, false = _clean(workdir, steps, "on", [])
            report["false_positives_clean_run"] = false
            report["step_s_clean_run"] = round(on_s, 5)
        if "overhead" in parts:
            ratios = []
            for k in range(args.overhead_rounds):
                order = ("on", "off") if k % 2 == 0 else ("off", "on")
                times = {}
                for which in order:
                    extra = [] if which == "on" else ["--straggler-window-steps", "0"]
                    times[which], _ = _clean(workdir, args.overhead_steps, f"{which}{k}", extra)
                ratios.append(times["on"] / times["off"])
            report["detection_overhead"] = round(median(ratios), 4)
            report["detection_overhead_range"] = [round(min(ratios), 4), round(max(ratios), 4)]
            report["detection_overhead_rounds"] = [round(r, 4) for r in ratios]
        if "straggler" in parts:
            report["straggler_detect_s"] = round(_straggler(workdir), 2)
        if "hang" in parts:
            detect, recovery = _hang(workdir)
            report["hang_detect_s"] = round(detect, 2)
            report["hang_recovery_s"] = round(recovery, 2)
    report["machine_before"], report["machine_after"] = before, machine_conditions()
    if args.json:
        print_json(report)
        return 0
    keys = [k for k in report if not k.startswith("machine_")]
    print(markdown_table(["key", "value"], [[k, report[k]] for k in keys]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
