"""The pure parts of `bench/recovery.py` (`bench/_recovery/progress.py`, `stats.py`,
`host.py`): the arithmetic of a kill sample from progress files and `restored` lines, spreads,
histogram quantiles and verdicts, what the host did during a stretch. The bench itself is not
run here (minutes of daemons)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _recovery import host, job, progress, stats


def _write(directory: Path, rank: int, pid: int, restart: int, times: list[float]) -> None:
    lines = [f"restart {restart}", *(f"{t:.6f}" for t in times)]
    (directory / f"progress-rank{rank}-pid{pid}.txt").write_text("\n".join(lines) + "\n")


def test_a_kill_sample_counts_steps_from_the_restored_step(tmp_path: Path) -> None:
    # The daemon's estimate build wrote no batch; rank 1's file is someone else's.
    _write(tmp_path, 0, 10, 0, [])
    _write(tmp_path, 0, 11, 0, [100.0, 100.5, 101.0, 101.5])  # steps 1..3 completed
    _write(tmp_path, 0, 12, 1, [104.0, 104.6, 105.1])
    _write(tmp_path, 1, 13, 0, [100.0])
    (tmp_path / "progress-rank0-pid14.txt").write_text("restart 2\n106.0\n106.")  # cut short
    (tmp_path / "progress-rank0-pid15.txt").write_text("resta")  # being created
    incs = progress.read_incarnations(tmp_path, rank=0)
    assert [(i.restart, i.pid) for i in incs] == [(0, 11), (1, 12), (2, 14)]
    assert incs[2].batch_starts == [106.0]
    events = [
        {"event": "restored", "rank": 0, "restart": 1, "pid": 12, "ckpt_step": 2},
        {"event": "restored", "rank": 1, "restart": 1, "pid": 13, "ckpt_step": 9},
    ]
    events[0]["source"], events[1]["source"] = "memory", "durable"
    restored = progress.restored_event(events, 0, incs[1])
    assert progress.restored_event(events, 0, incs[0]) is None
    sample = progress.kill_sample(101.7, incs[0], 0, incs[1], restored)
    assert sample.last_step == 3
    assert sample.restored_step == 2
    assert sample.steps_lost == 1
    assert sample.source == "memory"
    assert sample.recovery_s == pytest.approx(104.6 - 101.7)
    # Step 3 (the newest before the kill) is redone once line 3 (step 4's forward) is written.
    assert progress.lines_to_catch_up(incs[0], 0, 2) == 3
    assert sample.catchup_s == pytest.approx(105.1 - 101.7)
    assert progress.kill_sample(101.7, incs[0], 0, incs[1], None).catchup_s is None
    # Restart 1 started at step 2 and completed two steps before restart 2.
    assert progress.completed_steps(incs[1], 2) == 4
    with pytest.raises(ValueError, match="not completed a step"):
        progress.kill_sample(105.5, incs[1], 2, incs[2], None)
    assert progress.step_times(incs[0], skip=1) == pytest.approx([0.5, 0.5])


def test_two_processes_claiming_one_restart_are_two_incarnations_told_apart_by_pid(
    tmp_path: Path,
) -> None:
    # Seen on two nodes x 1 rank: a kill on node 1 restarted node 0's rank through a
    # membership change, which torch's agent does not count, so node 0's second and third
    # processes both logged restart 2 (the bench stopped with "two processes of rank None
    # logged restart 2").
    _write(tmp_path, 0, 7, 2, [5.0, 5.5])
    _write(tmp_path, 0, 3, 2, [1.0, 1.5])
    incs = progress.read_incarnations(tmp_path, rank=None)
    assert [(i.pid, i.restart) for i in incs] == [(3, 2), (7, 2)]  # in the order they started
    events = [
        {"event": "restored", "rank": 0, "restart": 2, "pid": 3, "ckpt_step": 4},
        {"event": "restored", "rank": 0, "restart": 2, "pid": 7, "ckpt_step": 9},
    ]
    assert progress.restored_event(events, None, incs[1])["ckpt_step"] == 9
    # Events of a daemon that did not log pids are matched by restart count.
    old = [{k: v for k, v in e.items() if k != "pid"} for e in events[:1]]
    assert progress.restored_event(old, None, incs[0])["ckpt_step"] == 4
    with pytest.raises(ValueError, match="starts with"):
        progress.parse_progress("1.0\n")


def test_histogram_quantile_interpolates_like_promql() -> None:
    inf = float("inf")
    # 100 observations: 90 in (0, 0.001], 10 in (0.001, 0.01].
    buckets = {0.001: 90.0, 0.01: 100.0, inf: 100.0}
    assert stats.percentile_from_histogram(buckets, 0.5) == pytest.approx(0.001 * 50 / 90)
    assert stats.percentile_from_histogram(buckets, 0.99) == pytest.approx(
        0.001 + 0.009 * (99 - 90) / 10
    )
    # In the +Inf bucket: the largest finite bound; nothing observed: None.
    assert stats.percentile_from_histogram({0.001: 1.0, inf: 10.0}, 0.99) == 0.001
    assert stats.percentile_from_histogram({0.001: 0.0, inf: 0.0}, 0.99) is None


def test_figures_judge_their_value_and_say_why_one_is_missing() -> None:
    fig = stats.figure(0.5, "<=", 0.4, samples=[0.4, 0.5, 0.6])
    assert fig["verdict"] == "MISSES"
    assert fig["target"] == "<= 0.4"
    assert fig["spread"]["median"] == 0.5
    assert fig["spread"]["min"] == 0.4
    assert fig["spread"]["max"] == 0.6
    lo, hi = fig["spread"]["median_ci95"]
    assert 0.4 <= lo <= 0.5 <= hi <= 0.6
    assert stats.figure(0, "==", 0)["verdict"] == "meets"
    assert stats.figure(None, ">=", 0.8)["verdict"] == "n/a"
    assert stats.figure(3.0, "<=", None)["verdict"] == "no target"
    missing = stats.figure("unavailable: no replicas", ">=", 0.8)
    assert missing["verdict"] == "unavailable"
    with pytest.raises(ValueError, match="unavailable"):
        stats.figure("0.9", ">=", 0.8)
    ratio = stats.bootstrap_ratio([1.0, 1.0, 1.2], [2.0, 2.0, 2.4])
    assert ratio["ratio"] == pytest.approx(0.5)
    assert stats.bootstrap_ratio([1.0], []) == {}


def test_progress_lines_are_the_training_loops_forwards_only(tmp_path: Path) -> None:
    """[Note: the bench times the training thread]: a forward run by the loop's
    `forward_backward` writes a line; one run elsewhere (the restore's zero step) does not.
    The loader's fetches (the prefetch thread, batches ahead of the step) write none."""
    import torch

    model = torch.nn.Linear(2, 2)
    path = tmp_path / "progress.txt"
    with path.open("a", encoding="ascii") as out:
        model.register_forward_pre_hook(job._Progress(out))

        def forward_backward() -> None:
            model(torch.zeros(1, 2))

        def materialize() -> None:
            model(torch.zeros(1, 2))

        materialize()
        forward_backward()
        forward_backward()
    assert len(path.read_text().splitlines()) == 2


def test_the_timeline_takes_the_agents_first_event_after_the_kill_and_the_slowest_rank() -> None:
    import recovery_timeline

    def at(second: float) -> str:
        return f"2026-12-04T05:00:{second:09.6f}Z"

    events = [
        {"event": "rank_failure_seen", "timestamp": at(9.0)},  # an earlier kill's
        {"event": "rank_failure_seen", "timestamp": at(10.2)},
        {"event": "ranks_stopped", "timestamp": at(10.25)},
        {"event": "process_group_up", "timestamp": at(10.5), "rank": 0, "restart": 2},
        {"event": "process_group_up", "timestamp": at(10.7), "rank": 1, "restart": 2},
        {"event": "process_group_up", "timestamp": at(12.0), "rank": 1, "restart": 3},
        {"event": "first_step_done", "timestamp": at(11.0), "rank": 0, "restart": 2},
    ]
    killed = recovery_timeline.event_unix({"timestamp": at(10.0)})
    got = recovery_timeline.timeline(events, killed, restart=2)
    assert got.keys() == {
        "rank_failure_seen",
        "ranks_stopped",
        "process_group_up",
        "first_step_done",
    }
    assert got["rank_failure_seen"] == pytest.approx(0.2)
    assert got["ranks_stopped"] == pytest.approx(0.25)
    assert got["process_group_up"] == pytest.approx(0.7)
    assert got["first_step_done"] == pytest.approx(1.0)


def test_one_nodes_processes_are_followed_whatever_their_global_rank(tmp_path: Path) -> None:
    # Node 0's only rank was global rank 0, then rank 1 after node 1's replacement took rank 0.
    _write(tmp_path, 0, 1, 0, [1.0, 1.5])
    _write(tmp_path, 1, 2, 1, [3.0])
    assert [i.restart for i in progress.read_incarnations(tmp_path, rank=None)] == [0, 1]
    events = [
        {"event": "restored", "rank": 1, "restart": 1, "ckpt_step": 2, "source": "replica"},
    ]
    assert progress.restored_by_restart(events, rank=None)[1]["ckpt_step"] == 2
    assert progress.restored_by_restart(events, rank=0) == {}


def test_a_figure_judged_on_its_bad_end_meets_only_if_its_interval_does() -> None:
    # Medians 1.01 below the 1.02 target, but the interval's upper end is above it.
    noisy = [0.99, 1.00, 1.01, 1.01, 1.05, 1.06]
    fig = stats.figure(1.01, "<=", 1.02, samples=noisy, judge_bad_end=True)
    assert fig["judged_on"] > 1.02
    assert fig["verdict"] == "unresolved"  # the target lies inside the interval
    above = [1.03, 1.04, 1.05, 1.06]
    assert stats.figure(1.05, "<=", 1.02, samples=above, judge_bad_end=True)["verdict"] == (
        "MISSES"
    )
    tight = [1.00, 1.005, 1.01, 1.01, 1.012]
    assert stats.figure(1.01, "<=", 1.02, samples=tight, judge_bad_end=True)["verdict"] == "meets"
    # For ">=" the lower end is judged; under 3 samples the value itself.
    low = stats.figure(0.9, ">=", 0.8, samples=[0.5, 0.9, 1.0, 1.1], judge_bad_end=True)
    assert low["judged_on"] == 0.5
    assert low["verdict"] == "unresolved"
    two = stats.figure(0.9, ">=", 0.8, samples=[0.5, 1.3], judge_bad_end=True)
    assert "judged_on" not in two
    assert two["verdict"] == "meets"


def test_the_recovery_ratio_compares_with_todays_path_and_the_warm_durable_one_beside_it() -> None:
    import recovery  # bench/recovery.py

    def rank_round(memory: str, recoveries: list[float], rank_start: str | None) -> dict:
        spec = {"failure": "rank", "topology": "1x2", "job_name": "default", "memory_every": memory}
        if rank_start is not None:  # results written before today's path existed lack it
            spec["rank_start"] = rank_start
        kills = [{"recovery_s": r, "catchup_s": r + 0.5, "steps_lost": 0} for r in recoveries]
        return {"spec": spec, "kills": kills, "step_times_s": [0.07] * 5}

    results = [
        rank_round("1", [0.5, 0.5, 0.6], "fork_server"),
        rank_round("0", [0.6, 0.6, 0.7], None),
        rank_round("0", [6.0, 6.5, 7.0], "spawn"),
    ]
    keys = recovery._keys(results, memcpy_bps=1e10, loopback_bps=1e9, replica_path=None)
    assert keys["rank_kill_recovery_vs_durable"]["value"] == pytest.approx(0.5 / 6.5)
    assert keys["rank_kill_recovery_vs_durable"]["verdict"] == "meets"
    assert keys["rank_kill_recovery_vs_warm_durable"]["value"] == pytest.approx(0.5 / 0.6)
    assert keys["rank_kill_recovery_vs_warm_durable"]["verdict"] == "MISSES"
    # The spawn round's step times are not the durable path's: the step keys see one off round.
    assert keys["memory_every_1_step_inflation"]["per_setting"]["default-1x2"]["step_s_off"] == [
        0.07
    ]
    without = recovery._keys(results[:2], memcpy_bps=1e10, loopback_bps=1e9, replica_path=None)
    assert without["rank_kill_recovery_vs_durable"]["verdict"] == "unavailable"


def test_step_inflation_counts_memcpys_at_the_ranks_threads_and_all_cores_beside_it() -> None:
    import recovery  # bench/recovery.py

    def step_round(memory: str, step_s: float) -> dict:
        spec = {"failure": "rank", "topology": "1x2", "job_name": "big", "memory_every": memory}
        return {
            "spec": spec, "kills": [], "step_times_s": [step_s] * 5,
            "state_bytes_per_rank": 100_000_000,
        }  # fmt: skip

    results = [step_round("0", 0.30), step_round("1", 0.32)]
    # A memcpy of 100 MB: 20 ms with the rank's threads (5 GB/s), 10 ms on all cores.
    keys = recovery._keys(
        results, memcpy_bps=5e9, loopback_bps=1e9, replica_path=None, memcpy_all_threads_bps=1e10
    )
    inflation = keys["memory_every_1_step_inflation"]
    assert inflation["value"] == pytest.approx(1.0)  # 20 ms more a step: one rank's memcpy
    assert inflation["in_all_threads_memcpys"]["median"] == pytest.approx(2.0)


def test_the_memcpy_reference_runs_at_the_threads_asked_and_leaves_torchs_pool_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from _recovery import machine

    before = torch.get_num_threads()
    set_to: list[int] = []
    real_set = torch.set_num_threads

    def recording_set(n: int) -> None:
        set_to.append(n)
        real_set(n)

    monkeypatch.setattr(torch, "set_num_threads", recording_set)
    assert machine.memcpy_bytes_per_s(8 << 20, repeats=2, threads=1) > 0
    assert set_to == [1, before]
    set_to.clear()
    assert machine.memcpy_bytes_per_s(8 << 20, repeats=2, threads=0) > 0
    assert set_to == [before]  # torch's own pool, only put back
    assert torch.get_num_threads() == before


def test_histograms_from_json_add_bucket_by_bucket_under_float_bounds() -> None:
    merged = stats.merge_histograms([{"0.005": 3.0, "inf": 4.0}, {"0.005": 1.0, "inf": 1.0}, {}])
    assert merged == {0.005: 4.0, float("inf"): 5.0}


def test_the_stretch_probe_counts_a_processs_cpu_and_the_memory_its_guest_reported(
    tmp_path: Path,
) -> None:
    import subprocess

    import recovery  # bench/recovery.py

    (tmp_path / "reported_kib").write_text("1000\n")
    (tmp_path / "page_reporting_order").write_text("9\n")
    (tmp_path / "free_bitmap_enable").write_text("Y\n")
    assert host.page_reporting(tmp_path) == {
        "free_bitmap_enable": "Y", "page_reporting_order": 9, "reported_kib": 1000,
    }  # fmt: skip
    assert host.page_reporting(tmp_path / "absent") is None
    # A process that touches 256 MiB of fresh pages and runs some user code between the
    # probe's two ends, then waits to be told to exit; one that is gone by then is left out.
    code = (
        "import sys\nsys.stdin.readline()\nb = bytearray(256 << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\nsum(range(10**6))\n"
        "print('done', flush=True)\nsys.stdin.readline()\n"
    )
    busy = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert busy.stdin is not None
    assert busy.stdout is not None
    try:
        probe = host.StretchProbe([busy.pid, gone.pid], tmp_path)
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline() == "done\n"
        (tmp_path / "reported_kib").write_text("3048\n")
        out = probe.end()
    finally:
        busy.stdin.close()
        busy.wait(timeout=60)
    assert out["rank_processes"] == 1
    assert out["rank_minor_faults"] >= (256 << 20) // 4096 // 2
    assert out["rank_user_cpu_s"] + out["rank_system_cpu_s"] > 0
    assert out["reported_to_host_mib"] == 2.0
    # The report's summary, per job, topology and setting.
    rounds = [
        {"spec": {"failure": "rank", "topology": "2x1", "job_name": "big", "memory_every": m},
         "kills": [], "stretch_host": {"rank_system_cpu_s": s, "reported_to_host_mib": r}}
        for m, s, r in (("0", 3.0, 10.0), ("auto", 3.5, 300.0), ("auto", 3.7, None))
    ]  # fmt: skip
    summary = recovery._stretch_host(rounds)
    assert summary["big-2x1-memauto"]["rank_system_cpu_s"]["median"] == pytest.approx(3.6)
    assert summary["big-2x1-memauto"]["reported_to_host_mib"]["n"] == 1
    assert summary["big-2x1-mem0"]["reported_to_host_mib"]["median"] == 10.0


def test_a_repetition_with_a_stalled_round_is_left_out_of_the_step_keys_by_name() -> None:
    import recovery  # bench/recovery.py

    def step_round(memory: str, repeat: int, times: list[float]) -> dict:
        spec = {
            "failure": "rank", "topology": "2x1", "job_name": "big", "memory_every": memory,
            "repeat": repeat,
        }  # fmt: skip
        return {"spec": spec, "kills": [], "step_times_s": times, "state_bytes_per_rank": 10**8}

    steady = [0.30] * 20
    results = [
        *(step_round(m, 0, [0.30] * 20) for m in ("0", "1")),
        step_round("auto", 0, [0.306] * 20),
        *(step_round(m, 1, [0.30] * 20) for m in ("1", "auto")),
        # The tier-off round of the second repetition stops for 9 s in one step (30 x its
        # median): its mean would make `auto` look 2.4x faster.
        step_round("0", 1, [*steady[:19], 9.0]),
        # 5 x its median: slow, not a stall; it stays.
        *(step_round(m, 2, [0.30] * 20) for m in ("1", "auto")),
        step_round("0", 2, [*steady[:19], 1.5]),
    ]
    keys = recovery._keys(results, memcpy_bps=5e9, loopback_bps=1e9, replica_path=None)
    auto = keys["auto_step_inflation"]
    assert auto["disturbed"] == [
        {"job": "big", "topology": "2x1", "repeat": 1, "memory_every": "0",
         "longest_step_s": 9.0, "median_step_s": 0.3},
    ]  # fmt: skip
    assert auto["per_setting"]["big-2x1"]["n"] == 2  # repetitions 0 and 2
    assert auto["per_setting"]["big-2x1"]["min"] == pytest.approx(0.30 / 0.36)
    assert auto["per_setting"]["big-2x1"]["max"] == pytest.approx(1.02)
    assert keys["memory_every_1_step_inflation"]["disturbed"] == auto["disturbed"]
    assert keys["memory_every_1_step_inflation"]["step_time_ratio"]["big-2x1"]["n"] == 2


def test_a_budget_runs_whole_repetitions_while_the_longest_round_says_they_fit() -> None:
    import recovery  # bench/recovery.py
    from _recovery.rounds import RoundSpec

    def spec(job: str, memory: str, repeat: int, failure: str = "rank") -> RoundSpec:
        return RoundSpec(
            topology="2x1", job_name=job, memory_every=memory, failure=failure, kills=0,
            measure_steps=10, repeat=repeat,
        )  # fmt: skip

    plan = [
        *(spec("default", m, 0) for m in ("0", "1", "auto")),
        *(spec("default", m, 1) for m in ("auto", "1", "0")),
        *(spec("default", m, 0, "node") for m in ("0", "1")),
        *(spec("big", m, 0) for m in ("0", "1", "auto")),
    ]
    blocks = recovery._blocks(plan)
    assert [len(b) for b in blocks] == [3, 3, 2, 3]
    assert [b[0].name for b in blocks] == [
        "rank-2x1-default-mem0", "rank-2x1-default-memauto-r1", "node-2x1-default-mem0",
        "rank-2x1-big-mem0",
    ]  # fmt: skip
    done = [{"wall_s": 30.0}, {"wall_s": 40.0}, {"wall_s": 35.0}]
    # Nothing run yet: the first block runs whatever the budget.
    assert recovery._fits(blocks[0], [], elapsed_s=0.0, budget_s=1.0)
    # 3 more rounds at the longest so far (40 s) after 105 s: 225 s.
    assert recovery._fits(blocks[1], done, elapsed_s=105.0, budget_s=225.0)
    assert not recovery._fits(blocks[1], done, elapsed_s=105.0, budget_s=224.0)
    assert recovery._fits(blocks[1], done, elapsed_s=105.0, budget_s=None)
