"""`trainingd status`: a running daemon's `/api/status` (or its run directory) as a summary.

    trainingd status                      the daemon at the config's metrics host and port
    trainingd status --url http://node3:9464
    trainingd status --run-dir /run/trainingd/job   the daemon is down: read its files
    trainingd status --json               the raw object instead of the summary

The summary: run id, node phase and step, each local rank (phase, step, heartbeat age, hung and
straggler marks), the newest durable and memory steps, and the last incidents (what, where,
detection and recovery seconds, steps lost, restore source, state, cause). Offline (`--run-dir`)
it is built from what the daemon leaves in its run directory: the ranks' last snapshots
(`ranks/local-<k>.json`) and the closed incidents (`incidents.jsonl`,
`daemon/observe/incidents.py`); open incidents live only in a running daemon.

Exit codes: 0 printed; 1 nothing answers at the URL, it is not a trainingd daemon, or the run
directory holds nothing (one line on stderr); 2 a bad configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from daemon.observe.incidents import INCIDENTS_FILE, KEEP, read_incidents
from daemon.rundir.snapshot import read_snapshot

__all__ = [
    "StatusUnavailableError",
    "add_arguments",
    "default_url",
    "fetch_status",
    "offline_status",
    "render",
    "run",
]

_TIMEOUT_S = 5.0
"""How long `/api/status` may take to answer."""
_EXIT_UNREACHABLE = 1


class StatusUnavailableError(Exception):
    """No status to show; the message is the one line printed."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `status` subcommand's flags (besides `--config`)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--url",
        default=None,
        help="the daemon's HTTP endpoint (default: http://<metrics_host>:<metrics_port> of the "
        "configuration)",
    )
    where.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="read the run directory's files instead (the daemon is down; needs a run_dir "
        "that outlives the daemon: --run-dir of `trainingd run`)",
    )
    parser.add_argument("--json", action="store_true", help="print the raw status object")


def default_url(host: str, port: int) -> str:
    """The URL of a daemon configured with `metrics_host`/`metrics_port`.

    Raises:
        StatusUnavailableError: the port is 0 (picked at start): only the daemon's log says it.
    """
    if port == 0:
        raise StatusUnavailableError(
            "metrics_port is 0 (the daemon picked a free port): pass --url (see the "
            "daemon_started log line) or --run-dir"
        )
    if host in ("", "0.0.0.0", "::"):  # listening everywhere: this machine answers too
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def fetch_status(url: str, timeout_s: float = _TIMEOUT_S) -> dict[str, Any]:
    """The daemon's `/api/status` object.

    Raises:
        StatusUnavailableError: nothing answers, or the answer is not a trainingd status.
    """
    endpoint = url.rstrip("/") + "/api/status"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as err:
        raise StatusUnavailableError(
            f"{url} answered HTTP {err.code} for /api/status: not a trainingd daemon?"
        ) from None
    except (urllib.error.URLError, OSError, ValueError):
        raise StatusUnavailableError(
            f"no daemon answers at {url} (is it running? use --url or --run-dir)"
        ) from None
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not isinstance(status, dict) or "node" not in status:
        raise StatusUnavailableError(f"{url}/api/status is not a trainingd status object")
    return status


def offline_status(run_dir: Path, run_id: str = "") -> dict[str, Any]:
    """A status object built from a run directory's files (the daemon is down).

    Raises:
        StatusUnavailableError: the directory holds neither rank snapshots nor incidents.
    """
    if not run_dir.is_dir():
        raise StatusUnavailableError(f"no run directory at {run_dir}")
    now = time.time()
    snapshots = sorted((run_dir / "ranks").glob("local-*.json"))
    ranks = []
    for path in snapshots:
        data = read_snapshot(path)
        if data is None:
            continue
        gauges = data.get("gauges", {})
        beat = _gauge(gauges, "trainingd_rank_heartbeat_timestamp_seconds")
        step = _gauge(gauges, "trainingd_train_step")
        ranks.append(
            {
                "rank": int(data["rank"]),
                "local_rank": int(path.stem.removeprefix("local-")),
                "phase": str(data.get("phase", "-")),
                "step": None if step is None else int(step),
                "heartbeat_age_s": None if beat is None else round(now - beat, 2),
                "durable_step": _gauge(gauges, "trainingd_ckpt_last_committed_step"),
                "memory_step": _gauge(gauges, "trainingd_memory_newest_step"),
            }
        )
    incidents = read_incidents(run_dir / INCIDENTS_FILE)
    if not ranks and not incidents:
        raise StatusUnavailableError(
            f"{run_dir} holds no rank snapshots and no {INCIDENTS_FILE}: not a run directory?"
        )
    durable = [x for r in ranks if isinstance(x := r["durable_step"], float)]
    memory = [x for r in ranks if isinstance(x := r["memory_step"], float)]
    steps = [x for r in ranks if isinstance(x := r["step"], int)]
    # Restorable from memory only when every rank holds it (as the daemon's board says).
    held = int(min(memory)) if memory and len(memory) == len(ranks) else None
    return {
        "now_unix_s": now,
        "run_id": run_id,
        "offline": True,
        "run_dir": str(run_dir),
        "node": {"phase": "offline (read from the run directory)"},
        "step": min(steps) if steps else None,
        "max_steps": None,
        "ranks": ranks,
        "tiers": {
            "newest_durable_step": int(max(durable)) if durable else None,
            "newest_memory_step": held,
        },
        "incidents": [i.as_dict() for i in reversed(incidents[-KEEP:])],
    }


def _gauge(gauges: dict[str, Any], name: str) -> float | None:
    value = gauges.get(name, {}).get("")
    return None if value is None else float(value)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f} s"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def render(status: dict[str, Any]) -> str:
    """The human summary of a status object (`/api/status`, or `offline_status`)."""
    node = status.get("node") or {}
    step, max_steps = status.get("step"), status.get("max_steps")
    of = f" of {max_steps}" if max_steps else ""
    lines = [
        f"run {status.get('run_id') or '-'}  phase {node.get('phase', '-')}  "
        f"step {'-' if step is None else step}{of}"
        + (f"  restarts {node['restarts']}" if "restarts" in node else "")
    ]
    ranks = status.get("ranks") or []
    if ranks:
        rows = []
        for r in ranks:
            marks = [m for m in ("hung", "straggler") if r.get(m)]
            score = r.get("straggler_score")
            if score:
                marks.append(f"score {score:.2f}")
            rows.append(
                [
                    str(r["rank"]),
                    str(r.get("local_rank", "-")),
                    str(r.get("phase", "-")),
                    "-" if r.get("step") is None else str(r["step"]),
                    _seconds(r.get("heartbeat_age_s")),
                    ", ".join(marks),
                ]
            )
        lines.append("ranks:")
        lines += _table(["rank", "local", "phase", "step", "heartbeat age", "marks"], rows)
    else:
        lines.append("ranks: none reported yet")
    tiers = status.get("tiers") or {}
    durable, memory = tiers.get("newest_durable_step"), tiers.get("newest_memory_step")
    lines.append(
        f"checkpoints: newest durable step {'-' if durable is None else durable}, "
        f"newest memory step {'-' if memory is None else memory}"
    )
    incidents = status.get("incidents") or []
    if not incidents:
        lines.append("incidents: none")
        return "\n".join(lines)
    lines.append("incidents (newest first):")
    rows = []
    for i in incidents:
        where = (f"rank {','.join(str(r) for r in i['ranks'])} " if i["ranks"] else "") + (
            f"node {i['node']}"
        )
        rows.append(
            [
                str(i["id"]),
                i["kind"],
                where,
                _seconds(i.get("detection_s")),
                _seconds(i.get("recovery_s")),
                "-" if i.get("steps_lost") is None else str(i["steps_lost"]),
                i.get("source") or "-",
                i["state"],
                i["cause"],
            ]
        )
    header = ["#", "what", "where", "detection", "recovery", "steps lost", "source", "state"]
    lines += _table([*header, "cause"], rows)
    return "\n".join(lines)


def run(args: dict[str, Any], *, host: str, port: int, run_id: str) -> int:
    """Print the status the parsed `args` ask for; returns the exit code.

    Args:
        args: `url`, `run_dir`, `json` as parsed by `add_arguments`.
        host: the configuration's `metrics_host` (the default URL).
        port: the configuration's `metrics_port`.
        run_id: the configuration's run id (shown offline, where no daemon says it).
    """
    try:
        if args.get("run_dir") is not None:
            status = offline_status(Path(args["run_dir"]), run_id)
        else:
            status = fetch_status(args.get("url") or default_url(host, port))
    except StatusUnavailableError as err:
        print(f"trainingd: {err}", file=sys.stderr)
        return _EXIT_UNREACHABLE
    if args.get("json"):
        print(json.dumps(status, indent=2))
    else:
        print(render(status))
    return 0
