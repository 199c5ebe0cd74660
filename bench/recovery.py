"""Recovery from a killed rank and a lost node, with the memory tier off and on (issue 29).

Rounds (`bench/_recovery/rounds.py`), each one `trainingd run` per node on loopback, training
the bench's job (`bench/_recovery/job.py`: the default job, or it with a ballast parameter so
a rank holds `--state-mib` MiB of state, under `no_shard`):

- rank kills on one node x 2 ranks and on two nodes x 1 rank (or on a single rank, `1x1`,
  which leaves this 2-core VM a core for the daemon and the staging thread): `--kills` times
  one rank chosen at random is SIGKILLed at a random point (0.5-3 step times after the group
  trains again), with `memory_every 0` (the durable path, `ckpt_every 5`, ranks restarted
  warm from the fork server), `memory_every 1`, and today's path (`memory_every 0` with fresh
  interpreters, `rank_start spawn`: what a rank kill cost before issue 29; skipped with
  `--no-today-path`), the durable root on local disk or, with `--rank-durable s3`, on the
  loopback S3 server;
- node losses on two nodes x 1 rank, durable root on a loopback S3 server that counts the
  object bytes it serves (`bench/_recovery/s3count.py`): node 1's whole process group is
  SIGKILLed and a fresh daemon with an empty memory directory takes its place;
- before the first kill of every round `--measure-steps` step times are recorded, and one round
  per job and topology with `memory_every auto` and no kill gives the auto cadence's steps;
  `--step-rounds N` runs the off / 1 / auto rounds N times, interleaved (the kills in the
  first repetition only), and judges the step keys on their intervals ([Note: interleaved
  step rounds]).

Samples come from outside: the job's progress files (the time each rank's training loop
starts a step's forward: a step completed; [Note: the bench times the training thread] in
`_recovery/job.py`) and the ranks' `restored` lines (step and source) in the daemons' logs.
Keys, each with its spread, target and verdict (`bench/_recovery/stats.py`):
`rank_kill_steps_lost_max`, `rank_kill_recovery_s`, `rank_kill_recovery_vs_durable` (against
today's path, as the issue defines "off"), `rank_kill_recovery_vs_warm_durable` (against the
durable path with warm restarts: the memory tier's own share),
`rank_kill_catchup_s` (to the first step beyond the newest one completed before the kill),
`node_loss_steps_lost_max`, `node_loss_storage_bytes_read` (object GETs the S3 server answered
between the kill and the first step completed after it, but for the status page's own listing
of new checkpoints, which each request's User-Agent names and which is reported beside it as
`status_page_bytes_read`), `snapshot_stall_ms` (p99 of
`trainingd_memory_snapshot_seconds`, interpolated in its buckets),
`memory_every_1_step_inflation` (extra step time in memcpys of the rank's state, timed with
the rank's threads: [Note: a memcpy of the rank's state is the rank's own] in
`_recovery/machine.py`; the plain ratio and the figure in all-core memcpys beside it),
`auto_step_inflation`, `replica_throughput_vs_loopback` (the daemons' replica path alone,
`_recovery/machine.py`'s `replica_path_vs_loopback`, against a plain TCP
copy, interleaved, both on the idle machine; the 2x1 rounds' rate while the ranks train beside it;
`unavailable: ...` where the daemon has no peer replicas). The machine's memcpy rate and
loopback TCP rate are measured in the same run. Each round also says what the host did in its
measured stretch (`stretch_host`: the rank processes' user and system CPU seconds, page
faults, the MiB a guest reported to its hypervisor; per job, topology and setting in
`auto_step_inflation`), and `machine_before` / `machine_after` the guest's free page reporting
settings ([Note: a guest that hands freed memory back] in `_recovery/host.py`). A repetition
with a round that stalled (a step of 10x its median or more) is left out of the step keys and
named in them ([Note: a stalled stretch is left out, by name]).

    .venv/bin/python bench/recovery.py --quick          # smoke run: 3 kills, default job
    .venv/bin/python bench/recovery.py --json           # the full run (see --help)
    .venv/bin/python bench/recovery.py --jobs big --topologies 1x2 --kills 5
    .venv/bin/python bench/recovery.py --topologies 1x2 --node-kills 0 --rank-durable s3
    .venv/bin/python bench/recovery.py --jobs default --topologies 1x2 --kills 0 --node-kills 0 \
        --measure-steps 150 --step-rounds 3                # the step keys, interleaved
    .venv/bin/python bench/recovery.py --jobs big --topologies 1x2 --kills 0 --node-kills 0 \
        --measure-steps 150 --step-rounds 3 --ckpt-every 0 # the memory tier's own step cost
    .venv/bin/python bench/recovery.py --jobs big --kills 0 --node-kills 0 --step-rounds 4 \
        --budget-s 400                                     # as many repetitions as fit
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
from _common import MIB, machine_conditions, markdown_table, print_json
from _recovery import host, machine, rounds, stats
from _recovery.s3count import CountingS3

from tests.support.s3 import isolate_aws_environment

_OFF, _ON, _AUTO = "0", "1", "auto"
STALL_FACTOR = 10.0
"""A step this many times its round's median or longer is the machine stopping, not a cost of
the tier ([Note: a stalled stretch is left out, by name])."""
_WARM, _SPAWN = "fork_server", "spawn"


def _blocks(specs: list[rounds.RoundSpec]) -> list[list[rounds.RoundSpec]]:
    """The plan in runs of one job's repetition (`--step-rounds`' passes, the first with its
    kills and today's path) or its node-loss rounds, in order: what `--budget-s` runs or
    leaves whole."""
    runs = itertools.groupby(specs, key=lambda s: (s.job_name, s.failure, s.repeat))
    return [list(run) for _, run in runs]


def _fits(
    block: list[rounds.RoundSpec],
    results: list[dict[str, Any]],
    elapsed_s: float,
    budget_s: float | None,
) -> bool:
    """Whether `block` ends within `budget_s` if each of its rounds takes as long as the
    longest so far (the first block always runs: nothing says how long a round takes)."""
    if budget_s is None or not results:
        return True
    longest = max(r["wall_s"] for r in results)
    return elapsed_s + len(block) * longest <= budget_s


def _plan(args: argparse.Namespace) -> list[rounds.RoundSpec]:
    specs = []
    for job_name in args.jobs:
        common = {
            "job_name": job_name,
            "measure_steps": args.measure_steps,
            "warmup_steps": args.warmup_steps,
            "state_mib": args.state_mib,
            "seed": args.seed,
            "ckpt_every": args.ckpt_every,
            "replica_streams": args.replica_streams,
            "staging_nice": args.staging_nice,
        }
        # [Note: interleaved step rounds] `--step-rounds N` repeats the off / 1 / auto rounds
        # N times, interleaved and in reverse order every other time (off, 1, auto, then
        # auto, 1, off), so that a drift of the machine falls on every setting alike (this
        # VM's step time drifted 25% over nine rounds, and the last setting of each triplet
        # took all of it); the step keys are the medians of the per-repetition ratios
        # (adjacent rounds), judged on their intervals' bad ends. The kills run in the first
        # repetition only.
        for repeat in range(args.step_rounds):
            order = (_OFF, _ON, _AUTO) if repeat % 2 == 0 else (_AUTO, _ON, _OFF)
            for topology in args.topologies:
                for memory in order:
                    kills = args.kills if repeat == 0 and memory != _AUTO else 0
                    specs.append(
                        rounds.RoundSpec(
                            topology=topology, memory_every=memory, failure="rank",
                            kills=kills, repeat=repeat, **common,
                        )
                    )  # fmt: skip
                if repeat == 0 and args.kills and args.today_path:
                    # [Note: today's path] the "memory tier off (today's path)".
                    specs.append(
                        rounds.RoundSpec(
                            topology=topology, memory_every=_OFF, failure="rank",
                            kills=args.kills, rank_start=_SPAWN, **common,
                        )
                    )  # fmt: skip
        if "2x1" in args.topologies and args.node_kills > 0:
            for memory in (_OFF, _ON):
                specs.append(
                    rounds.RoundSpec(
                        topology="2x1", memory_every=memory, failure="node",
                        kills=args.node_kills, **common,
                    )
                )  # fmt: skip
    return specs


def _select(results: list[dict[str, Any]], **match: str) -> list[dict[str, Any]]:
    """The rounds whose spec matches; rounds of today's path (`rank_start spawn`) only when
    `rank_start` is asked for (results written before it existed started ranks warm)."""
    match = {"rank_start": _WARM, **match}
    return [
        r
        for r in results
        if all(
            r["spec"].get(k, _WARM if k == "rank_start" else None) == v for k, v in match.items()
        )
    ]


def _kills(results: list[dict[str, Any]], key: str, **match: str) -> list[float]:
    rows = [k for r in _select(results, **match) for k in r["kills"]]
    return [float(k[key]) for k in rows if k.get(key) is not None]


def _disturbed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step rounds whose measured stretch holds a step of `STALL_FACTOR` times its median
    step or more, with that step and the median.

    [Note: a stalled stretch is left out, by name] A snapshot, a replica or a durable save
    costs a step a fraction of itself to a few times itself; a step of seconds in a round is
    the machine stopping (a tier-off round on this VM stalled 34 s in one step, another took
    1-1.8 s steps while the guest's memory went back to its host: BENCHMARKS "Where `auto`'s
    2x1 cost goes on this VM"), and its ratio says nothing of the tier: the step keys then
    read 0.455 for `auto` / off. The step keys leave out every repetition that has such a
    round, whatever its setting, and list the rounds (`disturbed`) so that one of the tier's
    own is seen."""
    out = []
    for r in _select(results, failure="rank"):
        times = r.get("step_times_s") or []
        if not times:
            continue
        median, longest = statistics.median(times), max(times)
        if longest >= STALL_FACTOR * median:
            spec = r["spec"]
            out.append({
                "job": spec["job_name"], "topology": spec["topology"],
                "repeat": int(spec.get("repeat", 0)), "memory_every": spec["memory_every"],
                "longest_step_s": round(longest, 3), "median_step_s": round(median, 4),
            })  # fmt: skip
    return out


def _step_s(
    results: list[dict[str, Any]],
    statistic: Any = statistics.fmean,
    *,
    skip: frozenset[tuple[str, str, int]] = frozenset(),
    **match: str,
) -> dict[tuple[str, str, int], float]:
    """Step time per (job, topology, repetition) of the matching rounds: the mean (the
    measured stretch's wall time over its steps), or `statistic` of the step times.

    [Note: step keys on mean steps] The step keys compare mean steps: what a run's wall time
    pays. A median passes over the one step in n that a snapshot, or a replica of a durable
    save, slows: the 256 MiB job on 2x1 at `ckpt_every 5` stepped 0.999x the tier-off median
    under `auto` and 1.071x its mean (`bench/results/recovery_big_2x1_steps60_26d7554_20261205
    .json`). The medians stay beside them (`by_median`). Repetitions in `skip` are left out
    ([Note: a stalled stretch is left out, by name])."""
    out = {}
    for r in _select(results, **match):
        if r.get("step_times_s"):
            spec = r["spec"]
            key = (spec["job_name"], spec["topology"], int(spec.get("repeat", 0)))
            if key not in skip:
                out[key] = statistic(r["step_times_s"])
    return out


def _keys(
    results: list[dict[str, Any]],
    memcpy_bps: float,
    loopback_bps: float,
    replica_path: dict[str, list[float]] | None,
    memcpy_all_threads_bps: float | None = None,
) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    lost_on = _kills(results, "steps_lost", failure="rank", memory_every=_ON)
    keys["rank_kill_steps_lost_max"] = stats.figure(
        max(lost_on) if lost_on else None, "<=", 1, samples=lost_on, unit="steps",
        how="max over memory_every 1 rank kills of (newest step completed - step restored)",
        durable_samples=_kills(results, "steps_lost", failure="rank", memory_every=_OFF),
        todays_path_samples=_kills(
            results, "steps_lost", failure="rank", memory_every=_OFF, rank_start=_SPAWN
        ),
    )  # fmt: skip
    rec_on = _kills(results, "recovery_s", failure="rank", memory_every=_ON)
    rec_off = _kills(results, "recovery_s", failure="rank", memory_every=_OFF)
    rec_today = _kills(results, "recovery_s", failure="rank", memory_every=_OFF, rank_start=_SPAWN)
    keys["rank_kill_recovery_s"] = stats.figure(
        statistics.median(rec_on) if rec_on else None, "<=", None, samples=rec_on,
        unit="s", how="median SIGKILL -> first step completed after it, memory_every 1",
        durable=stats.spread(rec_off), todays_path=stats.spread(rec_today),
    )  # fmt: skip
    # [Note: today's path] The issue defines the key's "off" as today's path: the memory tier
    # off and the ranks respawned as fresh interpreters (what a rank kill cost before issue
    # 29). The same ratio against the durable path with warm restarts (this fork
    # server, only the memory tier off) is the tier's own share, reported beside it.
    ratio = stats.bootstrap_ratio(rec_on, rec_today)
    keys["rank_kill_recovery_vs_durable"] = stats.figure(
        ratio.get("ratio") if rec_today else "unavailable: run without --no-today-path",
        "<=", 0.4, unit="ratio",
        how="median recovery memory_every 1 / today's path (memory_every 0, rank_start spawn)",
        **ratio,
    )  # fmt: skip
    warm = stats.bootstrap_ratio(rec_on, rec_off)
    keys["rank_kill_recovery_vs_warm_durable"] = stats.figure(
        warm.get("ratio"), "<=", 0.4, unit="ratio",
        how="median recovery memory_every 1 / memory_every 0 with warm restarts (fork server)",
        **warm,
    )  # fmt: skip
    # Recovery ends at the first step completed, whichever it is; catching up ends once the
    # steps the kill lost are redone too (the durable path redoes up to `ckpt_every`).
    up_on = _kills(results, "catchup_s", failure="rank", memory_every=_ON)
    up_off = _kills(results, "catchup_s", failure="rank", memory_every=_OFF)
    up_today = _kills(results, "catchup_s", failure="rank", memory_every=_OFF, rank_start=_SPAWN)
    keys["rank_kill_catchup_s"] = stats.figure(
        statistics.median(up_on) if up_on else None, "<=", None, samples=up_on, unit="s",
        how="median SIGKILL -> first step beyond the killed group's newest completed, "
        "memory_every 1 (the lost steps redone)",
        durable=stats.spread(up_off),
        ratio_vs_durable=stats.bootstrap_ratio(up_on, up_off).get("ratio"),
        todays_path=stats.spread(up_today),
        ratio_vs_todays_path=stats.bootstrap_ratio(up_on, up_today).get("ratio"),
    )  # fmt: skip
    node_lost = _kills(results, "steps_lost", failure="node", memory_every=_ON)
    keys["node_loss_steps_lost_max"] = stats.figure(
        max(node_lost) if node_lost else None, "<=", 2, samples=node_lost, unit="steps",
        how="max over memory_every 1 node losses (node 1's process group, fresh daemon)",
        durable_samples=_kills(results, "steps_lost", failure="node", memory_every=_OFF),
    )  # fmt: skip
    node_read = _kills(results, "storage_bytes_read", failure="node", memory_every=_ON)
    keys["node_loss_storage_bytes_read"] = stats.figure(
        max(node_read) if node_read else None, "==", 0, samples=node_read, unit="bytes",
        how="max over node losses of the object bytes the S3 server (durable root) served "
        "between the kill and the first step completed after it (server-side count; the "
        "status page's timed listing, named by its User-Agent, apart)",
        durable_samples=_kills(results, "storage_bytes_read", failure="node", memory_every=_OFF),
        status_page_bytes_read=_kills(
            results, "status_page_bytes_read", failure="node", memory_every=_ON
        ),
        sources=sorted({k["source"] for r in _select(results, failure="node") for k in r["kills"]}),
    )  # fmt: skip
    on_rounds = _select(results, memory_every=_ON)
    buckets = stats.merge_histograms(r.get("snapshot_seconds_buckets", {}) for r in on_rounds)
    warmup = stats.merge_histograms(r.get("snapshot_seconds_buckets_warmup", {}) for r in on_rounds)
    p99 = stats.percentile_from_histogram(buckets, 0.99)
    keys["snapshot_stall_ms"] = stats.figure(
        None if p99 is None else p99 * 1000, "<=", 5, unit="ms",
        how="p99 of trainingd_memory_snapshot_seconds (training thread: save() + fence wait) "
        "over the memory_every 1 rounds' measured stretch, interpolated in its buckets; the "
        "warm-up's snapshots (a rank's first allocates its first slot file) apart",
        num_snapshots=buckets.get(float("inf"), 0.0),
        warmup_buckets={str(le): n for le, n in sorted(warmup.items())},
    )  # fmt: skip
    disturbed = _disturbed(results)
    skip = frozenset((d["job"], d["topology"], d["repeat"]) for d in disturbed)
    off, on, auto = (
        _step_s(results, memory_every=m, failure="rank", skip=skip) for m in (_OFF, _ON, _AUTO)
    )
    off_median, on_median, auto_median = (
        _step_s(results, statistics.median, memory_every=m, failure="rank", skip=skip)
        for m in (_OFF, _ON, _AUTO)
    )
    by_median: dict[str, dict[str, list[float]]] = {}
    for key, t_off in off_median.items():
        row_m = by_median.setdefault(f"{key[0]}-{key[1]}", {})
        for name, table in (("every_1", on_median), ("auto", auto_median)):
            if key in table:
                row_m.setdefault(f"{name}_ratio", []).append(table[key] / t_off)
    per_setting: dict[str, Any] = {}
    # Per (job, topology): one sample per repetition ([Note: interleaved step rounds]).
    extra_memcpys: dict[tuple[str, str], list[float]] = {}
    extra_all_threads: dict[tuple[str, str], list[float]] = {}
    on_ratios: dict[tuple[str, str], list[float]] = {}
    auto_ratios: dict[tuple[str, str], list[float]] = {}

    def state_of(job_name: str) -> int:
        rows = _select(results, job_name=job_name)
        return max((r.get("state_bytes_per_rank", 0) for r in rows), default=0)

    for key, t_off in sorted(off.items(), key=lambda item: (state_of(item[0][0]), item[0])):
        setting = key[:2]
        state = state_of(key[0])
        memcpy_s = state / memcpy_bps if state else None
        row = per_setting.setdefault(
            f"{key[0]}-{key[1]}", {"state_bytes_per_rank": state, "memcpy_s": memcpy_s}
        )
        row.setdefault("step_s_off", []).append(t_off)
        if key in on:
            row.setdefault("step_s_every_1", []).append(on[key])
            on_ratios.setdefault(setting, []).append(on[key] / t_off)
            if memcpy_s:
                extra_memcpys.setdefault(setting, []).append((on[key] - t_off) / memcpy_s)
            if state and memcpy_all_threads_bps:
                extra_all_threads.setdefault(setting, []).append(
                    (on[key] - t_off) * memcpy_all_threads_bps / state
                )
        if key in auto:
            row.setdefault("step_s_auto", []).append(auto[key])
            auto_ratios.setdefault(setting, []).append(auto[key] / t_off)
    # Judged on the largest state (the last setting in that order): a few MiB copy in well
    # under the step times' noise.
    largest = list(extra_memcpys.values())[-1] if extra_memcpys else []
    largest_all_threads = list(extra_all_threads.values())[-1] if extra_all_threads else []
    keys["memory_every_1_step_inflation"] = stats.figure(
        statistics.median(largest) if largest else None, "<=", 1, samples=largest,
        unit="memcpys of the rank's state per step", judge_bad_end=True,
        how="(mean step at memory_every 1 - at 0) / (state bytes / memcpy rate, the rank's "
        "threads) of the largest state's job (last topology), median over the interleaved "
        "repetitions; the plain ratios in step_time_ratio, the same extra time in memcpys on "
        "all cores in in_all_threads_memcpys, the ratios of median steps in by_median; a "
        "repetition with a stalled round left out (disturbed)",
        step_time_ratio={f"{j}-{t}": stats.spread(v) for (j, t), v in on_ratios.items()},
        in_all_threads_memcpys=(
            stats.spread(largest_all_threads) if largest_all_threads else None
        ),
        per_setting=per_setting,
        by_median={
            name: {k: stats.spread(v) for k, v in row.items()} for name, row in by_median.items()
        },
        disturbed=disturbed,
    )  # fmt: skip
    worst = max(auto_ratios.values(), key=statistics.median, default=[])
    keys["auto_step_inflation"] = stats.figure(
        statistics.median(worst) if worst else None, "<=", 1.02, samples=worst,
        unit="ratio", judge_bad_end=True,
        how="mean step at memory_every auto / at 0 (adjacent rounds; [Note: step keys on "
        "mean steps]), median over the interleaved repetitions, worst job and topology; the "
        "ratios of median steps in by_median; a repetition with a stalled round left out "
        "(disturbed)",
        per_setting={f"{j}-{t}": stats.spread(v) for (j, t), v in auto_ratios.items()},
        by_median={
            name: stats.spread(row["auto_ratio"])
            for name, row in by_median.items()
            if "auto_ratio" in row
        },
        stretch_host=_stretch_host(results),
        disturbed=disturbed,
    )  # fmt: skip
    keys["replica_throughput_vs_loopback"] = _replica_figure(results, loopback_bps, replica_path)
    return keys


def _machine() -> dict[str, Any]:
    """The machine's conditions, with the guest's free page reporting settings (None without)."""
    return {**machine_conditions(), "free_page_reporting": host.page_reporting()}


def _stretch_host(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the host did in the step rounds' measured stretches, per job, topology and
    setting: the rank processes' system CPU seconds and the MiB the guest reported to its
    hypervisor ([Note: a guest that hands freed memory back] in `_recovery/host.py`)."""
    out: dict[str, dict[str, Any]] = {}
    for r in _select(results, failure="rank"):
        found = r.get("stretch_host")
        if not found:
            continue
        spec = r["spec"]
        row = out.setdefault(f"{spec['job_name']}-{spec['topology']}-mem{spec['memory_every']}", {})
        for name in ("rank_system_cpu_s", "reported_to_host_mib"):
            if found.get(name) is not None:
                row.setdefault(name, []).append(found[name])
    return {name: {k: stats.spread(v) for k, v in row.items()} for name, row in sorted(out.items())}


def _replica_figure(
    results: list[dict[str, Any]], loopback_bps: float, path: dict[str, list[float]] | None
) -> dict[str, Any]:
    how = (
        "replica bytes/s of the daemons' replica path (a memory-tier snapshot streamed by "
        "ReplicaSender to a ReplicaServer on 127.0.0.1, the server's receive counters) / a "
        "plain TCP copy of the same bytes on loopback just before it, both on the idle "
        "machine, median over interleaved rounds judged on its interval; the 2x1 rounds' "
        "rate while both nodes' ranks train beside it"
    )
    if not rounds.replica_config_supported() or path is None:
        why = "unavailable: no [checkpoint] memory_replica_address in this daemon (no replicas)"
        return stats.figure(why, ">=", 0.8, how=how)
    totals: dict[str, float] = {}
    for r in _select(results, topology="2x1", memory_every=_ON):
        for name, value in r.get("replica_metrics", {}).items():
            totals[name] = totals.get(name, 0.0) + value
    num_bytes = [v for n, v in totals.items() if "bytes" in n and n.endswith("_total")]
    seconds = [v for n, v in totals.items() if "seconds" in n and n.endswith(("_sum", "_total"))]
    training_bps = num_bytes[0] / seconds[0] if num_bytes and seconds and seconds[0] else None
    # The same plain copy taken while the 2x1 rounds trained (`rounds.py`): what loopback TCP
    # gives under the load the replicas stream under, for the reader to compare.
    loaded = [
        r["loopback_under_load_bytes_per_s"]
        for r in _select(results, topology="2x1", memory_every=_ON)
        if r.get("loopback_under_load_bytes_per_s")
    ]
    loaded_bps = statistics.median(loaded) if loaded else None
    ratios = [
        received / plain
        for received, plain in zip(
            path["receive_bytes_per_s"], path["loopback_bytes_per_s"], strict=True
        )
    ]
    return stats.figure(
        statistics.median(ratios), ">=", 0.8, samples=ratios, unit="ratio", how=how,
        judge_bad_end=True, path=path,
        during_training_bytes_per_s=training_bps, counters=totals,
        during_training_vs_loopback=training_bps / loopback_bps if training_bps else None,
        loopback_under_load_bytes_per_s=loaded_bps,
        during_training_vs_loopback_under_load=(
            training_bps / loaded_bps if training_bps and loaded_bps else None
        ),
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 kills, default job")
    parser.add_argument("--kills", type=int, default=10, help="rank kills per round")
    parser.add_argument("--node-kills", type=int, default=10, help="node losses per round")
    parser.add_argument("--measure-steps", type=int, default=30, help="steps timed per round")
    parser.add_argument(
        "--warmup-steps", type=int, default=5,
        help="steps before the timed ones (default 5). The memory tier's first snapshots "
        "allocate slot files (an extra slot where a durable write and the kept step hold "
        "both) and the peer's first replicas its replica slots: one-time costs of 0.2-0.7 s "
        "a step for the 256 MiB job on 2x1, which a warm-up past auto's second snapshot "
        "(about 60 steps there) leaves out of the steady state",
    )  # fmt: skip
    parser.add_argument("--state-mib", type=int, default=256, help="state per rank, big job")
    parser.add_argument("--jobs", nargs="+", default=["default", "big"], choices=["default", "big"])
    parser.add_argument(
        "--topologies", nargs="+", default=["1x2", "2x1"], choices=["1x2", "2x1", "1x1"]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--replica-streams", type=int, default=0,
        help="the daemons' memory_replica_streams (default: theirs)",
    )  # fmt: skip
    parser.add_argument(
        "--staging-nice", type=int, default=None,
        help="the daemons' staging_nice (default: theirs)",
    )  # fmt: skip
    parser.add_argument(
        "--no-today-path", dest="today_path", action="store_false",
        help="skip the rank kills on today's path (memory_every 0 with fresh interpreters, "
        "the issue's 'off'): rank_kill_recovery_vs_durable is then unavailable",
    )  # fmt: skip
    parser.add_argument(
        "--step-rounds",
        type=int,
        default=1,
        help="interleaved repetitions of the off / 1 / auto rounds (step keys judged on their "
        "intervals from 3 on)",
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        default=5,
        help="durable checkpoint interval of every round (default 5). A durable save is also a "
        "memory snapshot, and `auto` adds a memory-only one only when its interval comes due "
        "between them: with durable saves every 5 steps its arm snapshots no more than the off "
        "arm. `--ckpt-every 0 --kills 0 --node-kills 0` times the memory tier's own cost "
        "(`auto`'s cadence acting alone)",
    )
    parser.add_argument(
        "--rank-durable",
        choices=["local", "s3"],
        default="local",
        help="durable root of the rank-kill rounds: local disk (the default) or the loopback S3 "
        "server (as a production run's object store; node-loss rounds always use S3)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=None,
        help="seconds for the rounds (default: none): a repetition (one job's rounds of one "
        "--step-rounds pass, or the node-loss rounds) starts only if its rounds, each as long "
        "as the longest so far, end within it; the rest are listed in the JSON's not_run. The "
        "machine references after the rounds take 20-30 s more (256 MiB copies and transfers)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.ckpt_every == 0 and (args.kills or args.node_kills):
        parser.error(
            "--ckpt-every 0 leaves the tier-off rounds nothing to recover from: "
            "use it with --kills 0 --node-kills 0"
        )
    if args.quick:
        args.kills, args.node_kills, args.measure_steps, args.jobs = 3, 3, 15, ["default"]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # The replica path measured in this process logs through structlog: to stderr, info and
    # up (stdout holds only the table or the JSON object).
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    isolate_aws_environment()
    rng = random.Random(args.seed)
    before = _machine()
    started = time.monotonic()
    specs = _plan(args)
    results = []
    needs_s3 = args.rank_durable == "s3" or any(s.failure == "node" for s in specs)
    s3 = CountingS3().start() if needs_s3 else None
    not_run: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="recovery-") as tmp:
            for block in _blocks(specs):
                elapsed = time.monotonic() - started
                if not_run or not _fits(block, results, elapsed, args.budget_s):
                    not_run.extend(spec.name for spec in block)
                    continue
                for spec in block:
                    print(f"round {spec.name} ...", file=sys.stderr)
                    on_s3 = spec.failure == "node" or args.rank_durable == "s3"
                    uses_s3 = s3 if on_s3 else None
                    results.append(rounds.run_round(spec, Path(tmp), rng, uses_s3))
    finally:
        if s3 is not None:
            s3.stop()
    # The references move at least 256 MiB: a few MiB time the thread start, not the copy.
    state = max(max((r.get("state_bytes_per_rank", 0) for r in results), default=0), 256 * MIB)
    # [Note: a memcpy of the rank's state is the rank's own]: the daemons' default threads.
    memcpy_bps = machine.memcpy_bytes_per_s(state)
    memcpy_all_threads_bps = machine.memcpy_bytes_per_s(state, threads=0)
    loopback_bps = machine.loopback_tcp_bytes_per_s(state)
    replica_path = (
        machine.replica_path_vs_loopback(state) if rounds.replica_config_supported() else None
    )
    report: dict[str, Any] = {
        "keys": _keys(results, memcpy_bps, loopback_bps, replica_path, memcpy_all_threads_bps),
        "memcpy_bytes_per_s": memcpy_bps,
        "memcpy_all_threads_bytes_per_s": memcpy_all_threads_bps,
        "loopback_tcp_bytes_per_s": loopback_bps,
        "loopback_anonymous_memory_tcp_bytes_per_s": machine.loopback_tcp_bytes_per_s(
            state, shared_memory=False
        ),
        "loopback_cached_tcp_bytes_per_s": machine.loopback_cached_tcp_bytes_per_s(state),
        "reference_bytes": state,
        "rounds": results,
        "not_run": not_run,
        "args": vars(args),
        "wall_s": round(time.monotonic() - started, 1),
        "machine_before": before,
        "machine_after": _machine(),
    }
    if args.json:
        print_json(report)
        return 0
    rows = stats.verdict_table(report["keys"])
    print(markdown_table(["key", "value", "median (min-max, n)", "target", "verdict"], rows))
    print(f"memcpy {memcpy_bps / 1e9:.2f} GB/s (all threads {memcpy_all_threads_bps / 1e9:.2f}), ")
    print(f"loopback TCP {loopback_bps / 1e9:.2f} GB/s")
    print(f"{report['wall_s']} s, load {report['machine_after']['loadavg_1_5_15']}")
    if not_run:
        print(f"not run (--budget-s {args.budget_s:g}): {', '.join(not_run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
