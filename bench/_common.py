"""Helpers shared by the benchmarks in `bench/` (not a package: each script imports this file).

- rank spawning: `run_ranks` runs a module-level function on N fresh gloo ranks (spawned
  processes, one torch thread each) through `tests.support.dist.run_on_ranks`; every measured
  configuration gets fresh processes so that peak-RSS figures never mix;
- memory: `peak_rss_bytes` (the process's high-water mark, `VmHWM`), `current_rss_bytes`,
  `reset_peak_rss` (Linux `clear_refs`, so a phase's own peak can be read);
- timing and reporting: `median`, `ratio`, `markdown_table`, `machine_conditions` (load,
  cores, memory: other work on the machine moves the numbers, so every report states them).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    # The benches run as scripts (`python bench/x.py`); the test harness and the engines live
    # at the repository root. Spawned ranks inherit this path.
    sys.path.insert(0, str(REPO_ROOT))

MIB = 2**20

__all__ = [
    "MIB",
    "REPO_ROOT",
    "current_rss_bytes",
    "machine_conditions",
    "markdown_table",
    "median",
    "peak_rss_bytes",
    "print_json",
    "ratio",
    "reset_peak_rss",
    "run_ranks",
    "stdout_to_stderr",
]


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start (or the last `reset_peak_rss`).

    `VmHWM` rather than `getrusage().ru_maxrss`: the latter keeps the maximum across `exec`,
    so a spawned child could inherit its parent's peak.
    """
    return _status_kib("VmHWM") * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 900.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh spawned gloo ranks.

    `fn` must be a module-level function of the calling script. Returns the per-rank results.
    """
    from tests.support.dist import run_on_ranks

    return run_on_ranks(fn, world_size, *args, timeout_s=timeout_s, threads=threads, env=env)


def stdout_to_stderr() -> None:
    """Send this process's (and its future children's) stdout to stderr.

    Ranks call it first thing: libraries log to stdout (structlog's default), and the bench's
    own stdout must hold only the table or the JSON object.
    """
    sys.stdout.flush()
    os.dup2(2, 1)


def tied_gpt_config(spec: Mapping[str, Any]) -> Any:
    """The benches' GPT shape from a rank spec (`seq_len`, `layers`, `heads`, `d_model`), with
    tied embeddings (imported here, inside the rank process, like torch)."""
    from daemon import GPTConfig

    return GPTConfig(
        seq_len=spec["seq_len"],
        num_layers=spec["layers"],
        num_heads=spec["heads"],
        d_model=spec["d_model"],
        tie_embeddings=True,
    )


def median(values: Iterable[float]) -> float:
    """Median of a non-empty iterable."""
    data = list(values)
    if not data:
        raise ValueError("median of no values")
    return float(statistics.median(data))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """`numerator / denominator`, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def machine_conditions() -> dict[str, Any]:
    """What else was happening: load averages, cores, memory, versions, UTC time."""
    import torch

    load1, load5, load15 = os.getloadavg()
    meminfo: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0]) * 1024
    return {
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_count": os.cpu_count(),
        "loadavg_1_5_15": [round(load1, 2), round(load5, 2), round(load15, 2)],
        "mem_total_gib": round(meminfo["MemTotal"] / 2**30, 1),
        "mem_available_gib": round(meminfo["MemAvailable"] / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-markdown table; floats get 3 decimals below 100, none above; None is `n/a`."""
    text_rows = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in text_rows]
    return "\n".join(out)


def verdict_lines(report: Mapping[str, Any]) -> list[str]:
    """`key: value (target op x) meets|MISSES` for each of `report["targets"]` (`{key: (op,
    x)}`, op `<=` or `>=`; a `{"median", "min", "max"}` value is judged by its median), then
    `skipped NAME: why` for each of `report["skipped"]`."""
    lines = []
    for key, (op, target) in report["targets"].items():
        value = report.get(key)
        if isinstance(value, Mapping):  # {"median", "min", "max"}: the median is judged
            value = value.get("median")
        if value is None:
            lines.append(f"{key}: n/a (target {op} {target})")
            continue
        ok = value <= target if op == "<=" else value >= target
        lines.append(f"{key}: {value:.3f} (target {op} {target}) {'meets' if ok else 'MISSES'}")
    for name, why in report.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why.splitlines()[0] if why else ''}")
    return lines


def diagnostic_lines(report: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """`key: value (no target)` for each of `keys`: ratios reported beside the targets."""
    lines = []
    for key in keys:
        value = report.get(key)
        if isinstance(value, Mapping):
            value = value.get("median")
        lines.append(f"{key}: {'n/a' if value is None else f'{value:.3f}'} (no target)")
    return lines


def conditions_line(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """One line on the machine around a run (`machine_conditions()` before and after)."""
    return (
        f"load average before {before['loadavg_1_5_15']} after {after['loadavg_1_5_15']}, "
        f"{before['cpu_count']} cores, {before['mem_available_gib']} GiB available, "
        f"torch {before['torch']}"
    )


def print_json(obj: dict[str, Any]) -> None:
    """Print one JSON object on stdout (the `--json` output of every bench)."""
    print(json.dumps(obj, indent=2, sort_keys=True))
