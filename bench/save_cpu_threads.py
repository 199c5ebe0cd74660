"""Where a save's CPU goes, per thread: the state and manager of `bench/ckpt_vs_dcp.py`.

Two gloo ranks (`--world-size`) each build the bench's GPT + AdamW state (`--size-mib`), save
it twice untimed, then `--saves` times the way `ckpt_vs_dcp.py` counts CPU per save (`save()`,
the fence, `wait_until_finished()`), and report per save, in memcpys of the state (this
thread's CPU for one copy, fastest of 5):

- each thread of the rank process, from `/proc/self/task/*/stat` (named by Python's thread
  names: `MainThread`, `ckpt-stager-<rank>`, `ckpt-commit`, `ckpt-deleter`, gloo's own);
- the persistent writer process (`/proc/<pid>/stat`);
- `save()` alone on the training thread (`time.thread_time`), in memcpys and milliseconds;
- the finalizer's agreement rounds per save (its MAX all-reduces, counted);
- per thread, user and system CPU and minor / major page faults per save, and the writer's
  faults (issue 33: a slab faulted in again on every save would show here);
- the staging copy alone (`copy_payload_into_slab`, on the stager's CPU clock), per save.

`--unit-between-saves` also times one memcpy of the state on the training thread after each
save (every rank at once, as their stagers copied at once; its CPU is taken off the training
thread's) and gives the stager's ratio to their median: on a machine whose memory speed moves
with load, the fastest memcpy before the run is not the speed the saves got. `--no-stream`
(bench only) hands each shard to the writer once it is staged instead of streaming the write
behind the copy ([Note: streamed writes] in `_save/pipeline.py`), to tell the copy's own cost
from what the concurrent write adds to it.

Figures from `/proc` come in clock ticks (10 ms): use enough saves (the default 10).

`--profile` (issue 33) also runs every thread of the rank under cProfile, timed by its own
CPU clock (`time.thread_time`), and reports the fixed per-save work by part, in milliseconds
of CPU per save: flatten and plan in `save()`, the agreement rounds on the training thread,
the index and report skeleton, the report's pickling, the commit (manifest build, encode,
publish with the root catalog), the retention pass, thread starts. cProfile adds its own
cost to every Python call, so the parts read high (about 2x for call-heavy code); compare
them with each other and across commits, and take totals from the unprofiled run. A tiny
state (`--size-mib 1`: the bench GPT's 156 tensors at the smallest width) shows the fixed
work alone.

    .venv/bin/python bench/save_cpu_threads.py [--size-mib 128] [--saves 10] [--json]
    .venv/bin/python bench/save_cpu_threads.py --size-mib 1 --saves 40 --profile
    .venv/bin/python bench/save_cpu_threads.py --size-mib 512 --saves 8 --unit-between-saves
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import threading
import time
from typing import Any

import _common
import ckpt_vs_dcp as bench

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _thread_stats() -> dict[str, tuple[float, float, int, int]]:
    """Every live thread of this process, by name (summed over equal names): (user CPU s,
    system CPU s, minor faults, major faults)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[float, float, int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or comm
        # After the ")": [7] minflt, [9] majflt, [11] utime, [12] stime (clock ticks).
        mine = (
            int(fields[11]) / _TICKS_PER_S,
            int(fields[12]) / _TICKS_PER_S,
            int(fields[7]),
            int(fields[9]),
        )
        prev = out.get(name, (0.0, 0.0, 0, 0))
        out[name] = (prev[0] + mine[0], prev[1] + mine[1], prev[2] + mine[2], prev[3] + mine[3])
    return out


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name (summed over equal names)."""
    return {name: s[0] + s[1] for name, s in _thread_stats().items()}


def _process_faults(pid: int | None) -> tuple[int, int]:
    """(minor, major) page faults of the process `pid` (this one if None), all threads."""
    with open(f"/proc/{pid or 'self'}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[9])


# (part, "module:qualname" of the functions counted): the CPU of their calls (cumulative, the
# largest if several match), on whichever thread runs them. Nested parts (the commit's build
# and encode) are listed under their parent.
_PARTS = (
    ("save(): flatten", "ckpt_manager._format.tree:flatten"),
    ("save(): plan", "ckpt_manager._save.plan:PlanCache.plan"),
    ("agreement rounds (training thread)", "ckpt_manager._save.finalize:Finalizer.run"),
    (
        "index + report skeleton",
        "ckpt_manager._save.report:ReportCache.prepare ckpt_manager._save.report:prepare_rank",
    ),
    ("report pickling", "ckpt_manager._save.report:encode_report_body"),
    ("copy + checksum", "ckpt_manager._save.staging:copy_payload_into_slab"),
    ("commit, whole", "ckpt_manager._save.commit:commit_step"),
    ("commit: manifest build", "ckpt_manager._save.commit:build_top_manifest"),
    ("commit: manifest encode", "ckpt_manager._format.manifest:Manifest.to_json"),
    ("commit: publish + catalog", "ckpt_manager._store.publish:publish_manifest"),
    ("commit: reports decoded", "ckpt_manager._save.report:decode_report"),
    ("retention pass", "ckpt_manager._retention.deleter:Deleter._pass"),
    ("retention: manifests read", "ckpt_manager._store.steps:read_manifest"),
    ("thread starts", "threading:Thread.start"),
)


def _code_keys(spec: str) -> set[tuple[str, int, str]]:
    """pstats keys (file, first line, name) of the functions `spec` names (those that exist
    in this tree: an older commit may lack some)."""
    import importlib

    keys = set()
    for name in spec.split():
        module, _, qualname = name.partition(":")
        obj: Any = importlib.import_module(module)
        for attr in qualname.split("."):
            obj = getattr(obj, attr, None)
        code = getattr(obj, "__code__", None)
        if code is not None:
            keys.add((code.co_filename, code.co_firstlineno, code.co_name))
    return keys


class _Profiles:
    """cProfile on every thread started after `install()`, and on the calling thread."""

    def __init__(self) -> None:
        self.by_thread: dict[str, cProfile.Profile] = {}
        self.main = cProfile.Profile(time.thread_time)

    def install(self) -> None:
        def start(*_: Any) -> None:
            profile = cProfile.Profile(time.thread_time)
            self.by_thread[threading.current_thread().name] = profile
            profile.enable()  # replaces this hook on this thread

        threading.setprofile(start)

    def parts_ms(self, saves: int) -> dict[str, float]:
        """CPU milliseconds per save of each of `_PARTS`, over every profiled thread."""
        threading.setprofile(None)
        wanted = {name: _code_keys(spec) for name, spec in _PARTS}
        out = dict.fromkeys(wanted, 0.0)
        for profile in [self.main, *self.by_thread.values()]:
            profile.disable()
            table = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            for name, keys in wanted.items():
                found = [table[k][3] for k in keys if k in table]  # cumulative seconds
                out[name] += max(found, default=0.0)
        return {k: round(v / saves * 1e3, 3) for k, v in out.items()}


def _rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    _common.stdout_to_stderr()
    from tests.support.agreement_rounds import counting_agreement_rounds

    copies = _time_staging_copies(no_stream=spec["no_stream"])
    with counting_agreement_rounds() as count:
        out = _measure(rank, world_size, spec, count)
    # The measured saves' copies (the warm-up saves' came first).
    mine = sorted(copies[-spec["saves"] :])
    out["copy_x_memcpy"] = [round(c / out["memcpy_cpu_s"], 3) for c in mine]
    out["copy_median_ms"] = round(mine[len(mine) // 2] * 1e3, 3)
    return out


def _time_staging_copies(*, no_stream: bool) -> list[float]:
    """Time each staging copy (`copy_payload_into_slab`) by the staging thread's CPU clock;
    with `no_stream`, the writer gets each shard only once it is staged (bench only: local
    disk otherwise streams the write behind the copy, [Note: streamed writes]). Returns the
    list the copies' CPU seconds are appended to."""
    from ckpt_manager._save import pipeline

    copies: list[float] = []
    copy = pipeline.copy_payload_into_slab  # type: ignore[attr-defined]

    def timed(*args: Any, **kwargs: Any) -> tuple[int, int]:
        t0 = time.thread_time()
        try:
            return copy(*args, **kwargs)
        finally:
            copies.append(time.thread_time() - t0)

    pipeline.copy_payload_into_slab = timed  # type: ignore[attr-defined]
    if no_stream:
        pipeline.LocalPipeline._streams = lambda self, request: False  # type: ignore[method-assign]
    return copies


def _measure(rank: int, world_size: int, spec: dict[str, Any], count: Any) -> dict[str, Any]:
    trainer = bench._Trainer(spec, rank)
    memcpy_s, _ = bench._memcpy_s(trainer, 5)
    profiles = _Profiles() if spec["profile"] else None
    if profiles is not None:
        profiles.install()  # before the manager starts its threads
    mgr, _ = bench._manager(os.path.join(spec["dir"], "root"), spec, {})
    state = trainer.manager_state(rank, world_size)
    between = _UnitBetweenSaves(trainer) if spec["unit_between_saves"] else None

    def one_save() -> float:
        trainer.num_steps += 1
        state["step"] = trainer.num_steps
        t0 = time.thread_time()
        mgr.save(trainer.num_steps, state)
        save_s = time.thread_time() - t0
        mgr.before_optimizer_step()
        mgr.wait_until_finished()
        if between is not None:
            between.measure()
        return save_s

    with mgr:
        for _ in range(2):  # first saves allocate the slab and start the writer
            one_save()
        pid = mgr.writer_pid
        count.reset()  # agreement rounds of the measured saves only
        writer0, stats0, wfaults0 = bench._cpu_s(pid), _thread_stats(), _process_faults(pid)
        if profiles is not None:
            profiles.main.enable()
        if between is not None:
            between.cpu_s.clear()  # the warm-up saves' units
        save_s = sum(one_save() for _ in range(spec["saves"]))
        writer1, stats1, wfaults1 = bench._cpu_s(pid), _thread_stats(), _process_faults(pid)
    n = spec["saves"]
    if between is not None:  # the units are not the save's: off the training thread's CPU
        u, s_, f, m = stats1["MainThread"]
        stats1["MainThread"] = (u - sum(between.cpu_s), s_, f, m)
    # The other threads' profiles include the two warm-up saves: within 2 / n.
    parts = profiles.parts_ms(n) if profiles is not None else None
    threads0 = {k: v[0] + v[1] for k, v in stats0.items()}
    threads1 = {k: v[0] + v[1] for k, v in stats1.items()}
    threads = {k: (v - threads0.get(k, 0.0)) / n / memcpy_s for k, v in threads1.items()}
    zero = (0.0, 0.0, 0, 0)
    # Per thread and save: user and system CPU in memcpys, minor and major page faults.
    detail = {}
    for k, v in stats1.items():
        u0, s0, f0, m0 = stats0.get(k, zero)
        if v[0] + v[1] == u0 + s0 and v[2] == f0:
            continue  # idle thread
        detail[k] = {
            "user_x_memcpy": round((v[0] - u0) / n / memcpy_s, 3),
            "sys_x_memcpy": round((v[1] - s0) / n / memcpy_s, 3),
            "minflt": round((v[2] - f0) / n, 1),
            "majflt": round((v[3] - m0) / n, 1),
        }
    return {
        "memcpy_cpu_s": memcpy_s,
        "threads_x_memcpy": {k: round(v, 3) for k, v in threads.items() if v > 0},
        "writer_x_memcpy": round((writer1 - writer0) / n / memcpy_s, 3),
        "threads_detail": detail,
        "writer_faults_per_save": [(b - a) / n for a, b in zip(wfaults0, wfaults1, strict=True)],
        "save_call_x_memcpy": round(save_s / n / memcpy_s, 3),
        "save_call_ms": round(save_s / n * 1e3, 3),
        "agreement_rounds_per_save": round(count.rounds / n, 2),
        "cpu_ms_per_save": round(
            (sum(threads1.values()) - sum(threads0.values()) + writer1 - writer0) / n * 1e3, 3
        ),
        "parts_ms_under_cprofile": parts,
        "memcpy_between_saves_cpu_s": None if between is None else between.cpu_s,
    }


class _UnitBetweenSaves:
    """One memcpy of the state on the training thread after each save (`--unit-between-saves`):
    the unit at the memory speed of the moment, with the other ranks copying too (they do
    the same), next to the saves it measures, instead of once before them."""

    def __init__(self, trainer: Any) -> None:
        import torch

        self._tensors = [t for _, t in trainer.named_tensors()]
        self._dst = [torch.empty_like(t) for t in self._tensors]
        self.cpu_s: list[float] = []
        self.measure()  # first touch

    def measure(self) -> None:
        t0 = time.thread_time()
        for d, t in zip(self._dst, self._tensors, strict=True):
            d.copy_(t)
        self.cpu_s.append(time.thread_time() - t0)


def main(argv: list[str] | None = None) -> int:
    """Measure and print one line per rank (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="also the fixed per-save work by part (cProfile)"
    )
    parser.add_argument(
        "--unit-between-saves",
        action="store_true",
        help="also a memcpy of the state after each save, and the stager's ratio to its median",
    )
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="write each shard after its copy instead of streaming it behind the copy",
    )
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.saves < 1 or args.world_size < 1:
        parser.error("--size-mib, --saves and --world-size must be >= 1")
    with tempfile.TemporaryDirectory(prefix="save-cpu-threads-", dir="/tmp") as work:
        spec = {
            "size_mib": args.size_mib,
            "batch": 1,
            "seq_len": 64,
            "seed": 0,
            "dir": work,
            "async_mode": "persistent",
            "saves": args.saves,
            "profile": args.profile,
            "no_stream": args.no_stream,
            "unit_between_saves": args.unit_between_saves,
        }
        before = _common.machine_conditions()
        ranks = _common.run_ranks(_rank, args.world_size, spec, timeout_s=1200)
    result = {
        "size_mib": args.size_mib,
        "saves": args.saves,
        "streamed": not args.no_stream,
        "ranks": ranks,
    }
    result["conditions"] = {"before": before, "after": _common.machine_conditions()}
    if args.json:
        _common.print_json(result)
        return 0
    for rank, r in enumerate(ranks):
        total = sum(r["threads_x_memcpy"].values()) + r["writer_x_memcpy"]
        print(
            f"rank {rank}: {total:.2f} memcpys per save (memcpy {r['memcpy_cpu_s'] * 1e3:.1f} ms"
            f" of CPU); writer {r['writer_x_memcpy']}; save() {r['save_call_x_memcpy']}"
            f" ({r['save_call_ms']} ms); {r['agreement_rounds_per_save']} agreement rounds;"
            f" threads {r['threads_x_memcpy']}; all of it {r['cpu_ms_per_save']} ms of CPU per save"
        )
        print(
            f"    staging copy (copy_payload_into_slab, stager CPU): median"
            f" {r['copy_median_ms']} ms, per save in memcpys {r['copy_x_memcpy']}"
        )
        units = r["memcpy_between_saves_cpu_s"]
        if units:
            mid = sorted(units)[len(units) // 2]
            # No entry: the stager used less than a clock tick over the saves (a tiny state).
            stager = sum(v for k, v in r["threads_x_memcpy"].items() if k.startswith("ckpt-stager"))
            print(
                f"    memcpy between saves: median {mid * 1e3:.1f} ms (min {min(units) * 1e3:.1f},"
                f" max {max(units) * 1e3:.1f}); staging copy {r['copy_median_ms'] / 1e3 / mid:.2f}"
                f" and stager {stager * r['memcpy_cpu_s'] / mid:.2f} of these memcpys"
            )
        for name, d in r["threads_detail"].items():
            print(f"    {name:24s} {d}")
        print(f"    writer faults per save (minor, major): {r['writer_faults_per_save']}")
        if r["parts_ms_under_cprofile"] is not None:
            print(f"rank {rank} parts, ms of CPU per save under cProfile:")
            for name, ms in r["parts_ms_under_cprofile"].items():
                print(f"    {name:40s} {ms:8.3f}")
    print(_common.conditions_line(before, result["conditions"]["after"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
