"""Where a save's CPU goes, per thread: the state and manager of `bench/ckpt_vs_dcp.py`.

Two gloo ranks (`--world-size`) each build the bench's GPT + AdamW state (`--size-mib`), save
it twice untimed, then `--saves` times the way `ckpt_vs_dcp.py` counts CPU per save (`save()`,
the fence, `wait_until_finished()`), and report per save, in memcpys of the state (this
thread's CPU for one copy, fastest of 5):

- each thread of the rank process, from `/proc/self/task/*/stat` (named by Python's thread
  names: `MainThread`, `ckpt-stager-<rank>`, `ckpt-commit`, `ckpt-deleter`, gloo's own);
- the persistent writer process (`/proc/<pid>/stat`);
- `save()` alone on the training thread (`time.thread_time`), in memcpys and milliseconds;
- the finalizer's agreement rounds per save (its MAX all-reduces, counted).

Figures from `/proc` come in clock ticks (10 ms): use enough saves (the default 10).

    .venv/bin/python bench/save_cpu_threads.py [--size-mib 128] [--saves 10] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any

import _common
import ckpt_vs_dcp as bench

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name (summed over equal names)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or comm
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return out


def _rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    _common.stdout_to_stderr()
    from tests.support.agreement_rounds import counting_agreement_rounds

    with counting_agreement_rounds() as count:
        return _measure(rank, world_size, spec, count)


def _measure(rank: int, world_size: int, spec: dict[str, Any], count: Any) -> dict[str, Any]:
    trainer = bench._Trainer(spec, rank)
    memcpy_s, _ = bench._memcpy_s(trainer, 5)
    mgr, _ = bench._manager(os.path.join(spec["dir"], "root"), spec, {})
    state = trainer.manager_state(rank, world_size)

    def one_save() -> float:
        trainer.num_steps += 1
        state["step"] = trainer.num_steps
        t0 = time.thread_time()
        mgr.save(trainer.num_steps, state)
        save_s = time.thread_time() - t0
        mgr.before_optimizer_step()
        mgr.wait_until_finished()
        return save_s

    with mgr:
        for _ in range(2):  # first saves allocate the slab and start the writer
            one_save()
        pid = mgr.writer_pid
        count.reset()  # agreement rounds of the measured saves only
        writer0, threads0 = bench._cpu_s(pid), _thread_cpu_s()
        save_s = sum(one_save() for _ in range(spec["saves"]))
        writer1, threads1 = bench._cpu_s(pid), _thread_cpu_s()
    n = spec["saves"]
    threads = {k: (v - threads0.get(k, 0.0)) / n / memcpy_s for k, v in threads1.items()}
    return {
        "memcpy_cpu_s": memcpy_s,
        "threads_x_memcpy": {k: round(v, 3) for k, v in threads.items() if v > 0},
        "writer_x_memcpy": round((writer1 - writer0) / n / memcpy_s, 3),
        "save_call_x_memcpy": round(save_s / n / memcpy_s, 3),
        "save_call_ms": round(save_s / n * 1e3, 3),
        "agreement_rounds_per_save": round(count.rounds / n, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and print one line per rank (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", action="store_true")
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
        }
        before = _common.machine_conditions()
        ranks = _common.run_ranks(_rank, args.world_size, spec, timeout_s=1200)
    result = {"size_mib": args.size_mib, "saves": args.saves, "ranks": ranks}
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
            f" threads {r['threads_x_memcpy']}"
        )
    print(_common.conditions_line(before, result["conditions"]["after"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
