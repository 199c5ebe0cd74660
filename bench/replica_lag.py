"""How late a peer replica lands, and what a node loss would cost at each moment (issue 29).

One round of `bench/recovery.py`'s machinery on two nodes x 1 rank on loopback at
`memory_every 1`, no kill. An inotify watch on `/dev/shm` records, from outside the daemons,
the moment each rank's meta and each replica's meta is renamed into place (the step read from
the meta's bytes), and the job's progress files the moment each step completed. From them:

- `lag_ms`: a snapshot's meta on node 1 to its replica's meta on node 0 (p50, p90, max), and
  how many snapshots were replicated at all (a newer one supersedes an unsent older one);
- `loss_share`: for every millisecond of the measured stretch, the steps a loss of node 1
  would cost then: node 0's completed steps minus the newest step that node 0's own slots
  and node 1's replicas on node 0 both hold (the step the restore agreement would pick).

It reads what `bench/recovery.py --node-kills` samples a few dozen times, at every moment of a
round; the watch costs a meta read per rename.

    .venv/bin/python bench/replica_lag.py --steps 150 --json
    .venv/bin/python bench/replica_lag.py --job big --steps 40
"""

from __future__ import annotations

import argparse
import bisect
import collections
import ctypes
import ctypes.util
import itertools
import os
import random
import re
import select
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import machine_conditions, markdown_table, print_json
from _recovery import rounds
from _stats import quantile

_IN_MOVED_TO, _IN_CREATE, _IN_ISDIR = 0x80, 0x100, 0x40000000
Event = tuple[float, int, bool, int, int, int]
"""`(unix time, node, is a replica, rank, slot, step)` of one meta renamed into place."""
_STEP = re.compile(rb'"step":(\d+)')
_FILE = re.compile(r"trainingd-job-[0-9a-f]+-(\d+)/(replicas/)?rank-(\d+)\.slot-(\d+)\.json$")


class RenameWatch:
    """Records `(unix time, node, is replica, rank, slot, step)` for every meta renamed under
    the bench's tier directories in `/dev/shm` (inotify through libc)."""

    def __init__(self, root: str = "/dev/shm") -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, str] = {}
        self._watch(root)
        self.events: list[Event] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _watch(self, path: str) -> None:
        wd = self._add(self._fd, os.fsencode(path), _IN_MOVED_TO | _IN_CREATE)
        if wd >= 0:
            self._dirs[wd] = path

    def _run(self) -> None:
        while not self._stop.is_set():
            if not select.select([self._fd], [], [], 0.2)[0]:
                continue
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                continue
            now, at = time.time(), 0
            while at < len(buf):
                wd, mask, _, size = struct.unpack_from("iIII", buf, at)
                name = buf[at + 16 : at + 16 + size].rstrip(b"\0").decode()
                at += 16 + size
                base = self._dirs.get(wd)
                if base is None:
                    continue
                path = os.path.join(base, name)
                if mask & _IN_ISDIR:
                    if base != "/dev/shm" or name.startswith("trainingd-bench"):
                        self._watch(path)
                        for parent, subdirs, _ in os.walk(path):
                            for sub in subdirs:
                                self._watch(os.path.join(parent, sub))
                    continue
                found = _FILE.search(path)
                if found is None:
                    continue
                try:
                    with open(path, "rb") as f:
                        step = _STEP.search(f.read())
                except OSError:
                    continue
                if step is not None:
                    node, replica = int(found[1]), found[2] is not None
                    rank, slot = int(found[3]), int(found[4])
                    self.events.append((now, node, replica, rank, slot, int(step[1])))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)


def _progress(round_dir: Path, node: int) -> list[float]:
    """When each step completed on `node` (its longest incarnation's lines)."""
    files = list((round_dir / "progress" / f"node{node}").glob("progress-*.txt"))
    best = max(files, key=lambda p: p.stat().st_size)
    return [float(x) for x in best.read_text().split("\n")[1:] if x.strip()]


def analyse(events: list[Event], done0: list[float]) -> dict[str, Any]:
    """The lag and the loss shares (see the module docstring); `done0`: when each of node
    0's steps completed."""
    events = sorted(events)
    remote = {rank for _, node, replica, rank, _, _ in events if node == 1 and not replica}
    snapshots: dict[int, float] = {}
    replicas: dict[int, float] = {}
    own: dict[tuple[int, int], int] = {}  # node 0's (rank, slot) -> step
    held: dict[tuple[int, int], int] = {}  # node 1's replicas on node 0: (rank, slot) -> step
    timeline: list[tuple[float, int]] = []  # the newest step both hold, from each rename on
    for t, node, replica, rank, slot, step in events:
        if node == 1 and not replica and rank in remote:
            snapshots.setdefault(step, t)
        if node != 0:
            continue
        if replica and rank in remote:
            replicas.setdefault(step, t)
            held[rank, slot] = step
        elif not replica:
            own[rank, slot] = step
        else:
            continue
        timeline.append((t, max(set(own.values()) & set(held.values()), default=-1)))
    lags = sorted((replicas[s] - snapshots[s]) * 1e3 for s in snapshots if s in replicas)
    share: collections.Counter[int] = collections.Counter()
    times = [t for t, _ in timeline]
    t, end = done0[min(10, len(done0) - 1)], done0[-1]
    while t < end:
        i = bisect.bisect_right(times, t) - 1
        if i >= 0 and timeline[i][1] >= 0:
            share[bisect.bisect_right(done0, t) - 1 - timeline[i][1]] += 1
        t += 0.001
    total = sum(share.values()) or 1
    steps = sorted(b - a for a, b in itertools.pairwise(done0))
    return {
        "snapshots": len(snapshots),
        "replicated": len(lags),
        "lag_ms": {
            "p50": quantile(lags, 0.5) if lags else None,
            "p90": quantile(lags, 0.9) if lags else None,
            "max": lags[-1] if lags else None,
        },
        "loss_share": {str(k): round(v / total, 4) for k, v in sorted(share.items())},
        "step_ms_p50": quantile(steps, 0.5) * 1e3 if steps else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=("default", "big"), default="default")
    parser.add_argument("--steps", type=int, default=150, help="measured steps (after 5)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not sys.platform.startswith("linux") or not Path("/dev/shm").is_dir():
        print("replica_lag: needs Linux and /dev/shm (inotify, the tier's tmpfs)")
        return 2
    before = machine_conditions()
    spec = rounds.RoundSpec(
        topology="2x1", job_name=args.job, memory_every="1", failure="rank", kills=0,
        measure_steps=args.steps,
    )  # fmt: skip
    watch = RenameWatch()
    try:
        with tempfile.TemporaryDirectory(prefix="replica-lag-") as tmp:
            run = rounds.run_round(spec, Path(tmp), random.Random(0), None)
            done0 = _progress(Path(tmp) / spec.name, 0)
    finally:
        watch.close()
    result: dict[str, Any] = {
        "args": vars(args),
        "machine_before": before,
        "machine_after": machine_conditions(),
        **analyse(watch.events, done0),
        "state_bytes_per_rank": run.get("state_bytes_per_rank"),
    }
    if args.json:
        print_json(result)
    else:
        lag = result["lag_ms"]
        rows = [
            ["snapshot to replica p50 / p90 / max (ms)",
             " / ".join("-" if v is None else f"{v:.0f}" for v in lag.values())],
            ["snapshots replicated", f"{result['replicated']} of {result['snapshots']}"],
            ["step p50 (ms)", f"{result['step_ms_p50']:.0f}"],
            ["share of the time a node loss costs N steps",
             ", ".join(f"{k}: {v:.3f}" for k, v in result["loss_share"].items())],
        ]  # fmt: skip
        print(markdown_table(["", "value"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
