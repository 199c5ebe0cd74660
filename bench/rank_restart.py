"""Rank restart time: spawned ranks against ranks forked from the daemon's fork server.

Issue 29 (item 3). For each `rank_start` (`spawn`, then `fork_server`) one `trainingd run` of
the default job (2 local ranks, saves every 5 steps) is started; `--kills` times, once the
group trains, one rank chosen at random is SIGKILLed after a random 0.5-2 s of training, and
the time from the kill to the restarted group's first line of the training loop (the `training`
event of both local ranks of the new incarnation, from the ranks' JSON logs) is one sample.
That covers the agent noticing the failure, stopping the other rank, the new rendezvous, the
rank start (a fresh interpreter importing torch, or a fork), the process group, the job's
build and the restore of the newest checkpoint. Then the daemon is stopped (SIGTERM).

    .venv/bin/python bench/rank_restart.py             # a table
    .venv/bin/python bench/rank_restart.py --json      # one JSON object
    .venv/bin/python bench/rank_restart.py --kills 5

Keys: `rank_restart_s_<mode>` (every sample), `rank_restart_s_<mode>_median`,
`rank_restart_fork_server_vs_spawn` (median ratio, lower is better), `fork_server_preload_s`
(the server's imports at the daemon's start), `fork_server_rss_bytes`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    machine_conditions,
    markdown_table,
    median,
    print_json,
    ratio,
)

sys.path.insert(0, str(REPO_ROOT))

from tests.daemon._daemon_proc import DaemonProc, wait_for

MODES = ("spawn", "fork_server")
_ARGS = [
    "--nproc-per-node", "2", "--ckpt-every", "5", "--max-steps", "100000",
    "--warmup-steps", "2",
]  # fmt: skip
_START_TIMEOUT_S = 300.0


def _unix_s(event: dict[str, Any]) -> float:
    stamp = str(event["timestamp"]).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _training_at(d: DaemonProc, restart: int) -> float | None:
    """When both local ranks of incarnation `restart` logged `training` (None: not yet)."""
    events = [e for e in d.find("training") if int(e.get("restart", -1)) == restart]
    ranks = {int(e["local_rank"]): _unix_s(e) for e in events}
    return max(ranks.values()) if len(ranks) == 2 else None


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run(mode: str, kills: int, workdir: Path, rng: random.Random) -> dict[str, Any]:
    root = workdir / f"ckpt-{mode}"
    args = [*_ARGS, "--rank-start", mode, "--max-restarts", str(kills), "--ckpt-uri", str(root)]
    d = DaemonProc(workdir, args, name=mode)
    samples: list[float] = []
    out: dict[str, Any] = {}
    try:
        wait_for(lambda: _training_at(d, 0), _START_TIMEOUT_S, f"{mode}: first training")
        if mode == "fork_server":
            started = d.find("fork_server_started")
            assert started, d.logs()
            out["fork_server_preload_s"] = float(started[0]["preload_s"])
            out["fork_server_rss_bytes"] = _rss_bytes(int(started[0]["pid"]))
        for restart in range(1, kills + 1):
            time.sleep(rng.uniform(0.5, 2.0))  # a random point of training
            victim = rng.choice(wait_for(d.rank_pids, 30, f"{mode}: rank pids"))
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            at = wait_for(
                lambda r=restart: _training_at(d, r), _START_TIMEOUT_S, f"{mode}: restart {restart}"
            )
            samples.append(at - killed)
            print(f"{mode}: restart {restart}: {at - killed:.2f} s", file=sys.stderr)
        d.signal(signal.SIGTERM)
        out["exit_code"] = d.wait(120)
    finally:
        d.cleanup()
    out["samples"] = samples
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="kills per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    before = machine_conditions()
    report: dict[str, Any] = {"kills": args.kills}
    with tempfile.TemporaryDirectory(prefix="rank-restart-") as tmp:
        for mode in MODES:
            result = _run(mode, args.kills, Path(tmp), rng)
            report[f"rank_restart_s_{mode}"] = [round(s, 3) for s in result["samples"]]
            report[f"rank_restart_s_{mode}_median"] = round(median(result["samples"]), 3)
            report[f"exit_code_{mode}"] = result["exit_code"]
            for key in ("fork_server_preload_s", "fork_server_rss_bytes"):
                if key in result:
                    report[key] = result[key]
    report["rank_restart_fork_server_vs_spawn"] = ratio(
        report["rank_restart_s_fork_server_median"], report["rank_restart_s_spawn_median"]
    )
    report["machine_before"], report["machine_after"] = before, machine_conditions()
    if args.json:
        print_json(report)
        return 0
    rows = [
        [mode, report[f"rank_restart_s_{mode}_median"], report[f"rank_restart_s_{mode}"]]
        for mode in MODES
    ]
    print(markdown_table(["rank_start", "median s", "samples s"], rows))
    print(f"fork_server / spawn: {report['rank_restart_fork_server_vs_spawn']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
