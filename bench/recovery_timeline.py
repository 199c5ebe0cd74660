"""Where the time of one rank-kill recovery goes: a timeline from the daemon's own log events.

[Note: the recovery timeline]
One node x 2 ranks trains the recovery bench's job (`bench/_recovery/job.py`) at
`--log-level debug`; `--kills` times one rank chosen at random is SIGKILLed at a random point,
and each stage of the recovery is read from the first debug event that marks it (the agent's
in `daemon/agent/elastic.py`, the ranks' in `daemon/worker.py` and `daemon/rank/loop.py`):

    kill -> rank_failure_seen (agent's monitor) -> ranks_stopped (survivor gone)
         -> rendezvous_done -> ranks_started (forked) -> rank_entered (entry point runs)
         -> process_group_up -> job_loaded -> training_built (engine, optimizer, manager)
         -> restore_template_made -> restored -> first_step_done

Every stage is in seconds since the SIGKILL; a rank stage is the later of the two ranks'.
`first_step_done` matches `bench/recovery.py`'s `rank_kill_recovery_s` up to the progress
file's write (it ends at the same step's end).

    .venv/bin/python bench/recovery_timeline.py --kills 5 --memory-every 1 --json
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import machine_conditions, markdown_table, print_json
from _recovery import rounds

AGENT_STAGES = ("rank_failure_seen", "ranks_stopped", "rendezvous_done", "ranks_started")
RANK_STAGES = (
    "rank_entered",
    "process_group_up",
    "job_loaded",
    "training_built",
    "restore_template_made",
    "restored",
    "first_step_done",
)


def event_unix(event: dict[str, Any]) -> float:
    """Unix time of a log event (its ISO `timestamp`)."""
    return datetime.datetime.fromisoformat(event["timestamp"]).timestamp()


def timeline(events: list[dict[str, Any]], killed: float, restart: int) -> dict[str, float]:
    """Seconds from the kill to each stage of restart `restart` (absent: not seen)."""
    out: dict[str, float] = {}
    for name in AGENT_STAGES:
        times = [t for e in events if e.get("event") == name and (t := event_unix(e)) >= killed]
        if times:
            out[name] = min(times) - killed
    for name in RANK_STAGES:
        times = [
            event_unix(e)
            for e in events
            if e.get("event") == name and int(e.get("restart", -1)) == restart
        ]
        if times:
            out[name] = max(times) - killed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--memory-every", default="1")
    parser.add_argument("--job", default="default", choices=["default", "big"])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    spec = rounds.RoundSpec(
        topology="1x2", job_name=args.job, memory_every=args.memory_every, failure="rank",
        kills=args.kills, measure_steps=5, state_mib=args.state_mib, seed=args.seed,
    )  # fmt: skip
    before = machine_conditions()
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-timeline-") as tmp:
        r = rounds._Round(spec, Path(tmp), None)
        r.args += ["--log-level", "debug"]
        try:
            r.nodes = [r.start_node(0, "node0")]
            r.wait_started_after(0.0, spec.warmup_steps + spec.measure_steps, 300)
            for restart in range(1, spec.kills + 1):
                time.sleep(rng.uniform(0.5, 3.0) * 0.15)
                killed = time.time()
                victim = rng.choice(r.nodes[0].rank_pids())
                os.kill(victim, signal.SIGKILL)
                r.wait_started_after(killed, 3, 300)
                rows.append(timeline(r.nodes[0].events(), killed, restart))
                print(f"kill {restart}: {rows[-1]}", file=sys.stderr)
            r.nodes[0].signal(signal.SIGTERM)
            r.nodes[0].wait(300)
        finally:
            r.cleanup()
    stages = [*AGENT_STAGES, *RANK_STAGES]
    medians = {s: statistics.median([row[s] for row in rows if s in row]) for s in stages}
    report = {
        "stages": stages,
        "kills": rows,
        "median_s": medians,
        "args": vars(args),
        "machine_before": before,
        "machine_after": machine_conditions(),
    }
    if args.json:
        print_json(report)
        return 0
    table = [
        [s, f"{medians[s]:.3f}", " ".join(f"{row.get(s, float('nan')):.3f}" for row in rows)]
        for s in stages
    ]
    print(markdown_table(["stage", "median s after kill", "per kill"], table))
    print(f"load {report['machine_after']['loadavg_1_5_15']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
