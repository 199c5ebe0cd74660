"""Hang detection: a local rank whose progress word stops is declared hung and its group killed.

The supervisor hands every tick's rank views to `HangDetector.observe`. For each live local rank
it reads the progress word (`daemon/rundir/progress.py`) and keeps, on the daemon's clock, when
the word last changed. A rank whose word has not changed for its budget is hung:

- in the training loop the budget is `hang_timeout_s`, or, when that is `auto` (or 0),
  max(60 s, 10 x p99 step time) as the rank's step-duration histogram shows it (60 s before a
  step has been observed);
- during start-up and restore the budget is the larger of that and `heartbeat_timeout_s`: a
  restore beats (marks the word) on every read, so a long restore stays alive while bytes
  arrive, and one stuck on storage fails `/healthz` after `heartbeat_timeout_s` but is restarted
  only past the hang budget (a restart does not unstick the storage, and costs a restart).

On a hang the detector records every local rank's stacks (`STACK_DUMP_SIGNAL`, see
`daemon/rundir/stacks.py`; a process in state `T` is reported `stopped` instead, it cannot
answer), logs one `rank_hung` line per rank that is a cause (stopped, or stuck anywhere but in
a collective) and `rank_waiting` for the ranks that wait in a collective for it (the phase
`collective`, or a dump whose training thread blocks in torch.distributed or the engine's
collective wait, `daemon.rundir.stacks.waits_in_collective`; all of them when every stalled
rank waits and the job has other nodes: the cause is on one of those, whose daemon names it;
with no other node they are all named), records
the hang in its `HangLedger` (`daemon/observe/hangs.py`: `trainingd_rank_hung`,
`trainingd_rank_hangs_total`, the status page), and SIGKILLs every local rank's process group
so the elastic agent restarts the group (a counted restart; with the memory tier the new group
restores from memory). Stack dumps take up to `_DUMP_WAIT_S` of the supervisor's tick, once
per hang.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import structlog

from daemon._lifecycle import kill_group, pid_alive
from daemon.metrics import spec
from daemon.observe.collector import RankView
from daemon.observe.hangs import HangLedger, HangReport
from daemon.rundir.progress import ProgressPhase, progress_path, read_progress
from daemon.rundir.stacks import (
    STACK_DUMP_SIGNAL,
    hang_stacks_path,
    innermost_frame,
    parse_stacks,
    stacks_path,
    waits_in_collective,
)

__all__ = ["AUTO_FLOOR_S", "HangDetector", "HungRank", "auto_timeout_s", "process_stopped"]

log = structlog.get_logger("trainingd.hang")

AUTO_FLOOR_S = 60.0
"""The `auto` hang timeout is never below this."""
_AUTO_FACTOR = 10.0
_DUMP_WAIT_S = 1.0
_STEP_HISTOGRAM = "trainingd_train_step_duration_seconds"


class HungRank(NamedTuple):
    """One local rank found without progress at a hang."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node."""
    phase: ProgressPhase
    """Where its progress word stopped."""
    step: int
    """The step it was in."""
    idle_s: float
    """Seconds without progress."""
    stopped: bool
    """The process is stopped (state T): it could not dump its stacks."""
    frame: str | None
    """Innermost frame of our code or the job's, from its dump (None: no dump)."""
    waiting: bool
    """It waits in a collective: its phase is `collective`, or its dump shows a collective
    wait (`daemon.rundir.stacks.waits_in_collective`: the engine's reductions and all-gathers
    are waited on inside forward and backward)."""

    @property
    def cause(self) -> bool:
        """A cause of the hang (stopped, or stuck outside a collective), not a waiter."""
        return self.stopped or not self.waiting


def auto_timeout_s(views: list[RankView]) -> float:
    """max(`AUTO_FLOOR_S`, 10 x the p99 step time over the views' step histograms).

    The p99 is the upper edge of the bucket holding it (the last finite edge for +Inf).
    """
    buckets = spec(_STEP_HISTOGRAM).buckets
    counts = [0] * (len(buckets) + 1)
    for view in views:
        for per_bucket, _ in view.histograms.get(_STEP_HISTOGRAM, {}).values():
            counts = [a + b for a, b in zip(counts, per_bucket, strict=False)]
    total = sum(counts)
    if total == 0:
        return AUTO_FLOOR_S
    seen = 0
    for i, num in enumerate(counts):
        seen += num
        if seen >= 0.99 * total:
            p99 = buckets[min(i, len(buckets) - 1)]
            return max(AUTO_FLOOR_S, _AUTO_FACTOR * p99)
    return AUTO_FLOOR_S


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (state `T` or `t` in /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] in ("T", "t")


class HangDetector:
    """Tracks each local rank's last progress; declares hangs and restarts the group.

    Args:
        run_dir: the per-run directory (progress words, stack dumps).
        node: this node's rank (in log lines).
        hang_timeout_s: budget in the training loop; None (or 0): `auto`.
        startup_timeout_s: budget during start-up and restore (`heartbeat_timeout_s`).
        ledger: where declared hangs go for `/metrics` and the status page (a new one if
            None; `ledger` holds it).
        kill: kills one rank's process group (tests inject one).
        clock: monotonic time source.
        wall_clock: Unix time source (the reports' `unix_s`).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        node: int,
        hang_timeout_s: float | None,
        startup_timeout_s: float,
        ledger: HangLedger | None = None,
        kill: Callable[[int], object] = kill_group,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._run_dir = run_dir
        self._node = node
        self._timeout_s = hang_timeout_s
        self._startup_s = startup_timeout_s
        self._kill = kill
        self._clock = clock
        self._wall_clock = wall_clock
        self.ledger = ledger if ledger is not None else HangLedger()
        """The hangs declared here, read by the collector and the status board."""
        self._last: dict[int, tuple[tuple[int, int], float]] = {}
        self._declared: set[int] = set()
        self.num_hangs = 0
        """Hangs declared on this node since the daemon started."""

    def observe(self, views: list[RankView], now: float | None = None) -> list[HungRank]:
        """Check the live local ranks once; on a hang, report it and kill the group.

        Returns:
            The ranks found without progress when a hang was declared now, else [].
        """
        now = self._clock() if now is None else now
        live = [v for v in views if not v.phase.done and pid_alive(v.pid)]
        if not live:
            return []
        newest = max(v.restart for v in live)
        live = [v for v in live if v.restart == newest]
        timeout = self._timeout_s or auto_timeout_s(live)
        stalled: list[tuple[RankView, ProgressPhase, int, float]] = []
        over = trains = False
        for view in live:
            reading = read_progress(progress_path(self._run_dir, view.local_rank))
            if reading is None:
                continue
            key = (view.pid, reading.sequence)
            last = self._last.get(view.local_rank)
            if last is None or last[0] != key:
                self._last[view.local_rank] = (key, now)
                self._declared.discard(view.pid)
                if not reading.phase.startup:
                    # Back in the training loop (a restarted incarnation that restored).
                    self.ledger.recovered(view.rank)
                    trains = True
                continue
            idle = now - last[1]
            # Start-up and restore never get less than training: a read stuck on storage
            # turns /healthz stale after heartbeat_timeout_s; a restart would not unstick it.
            budget = max(self._startup_s, timeout) if reading.phase.startup else timeout
            stalled.append((view, reading.phase, reading.step, idle))
            over = over or (idle > budget and view.pid not in self._declared)
        if trains:
            # The node's group trains again: a hung rank it no longer runs (an elastic round
            # gave the node other global ranks) is not hung any more either.
            here = {v.rank for v in live}
            for rank in self.ledger.hung_ranks():
                if rank not in here:
                    self.ledger.recovered(rank)
        return self._declare(stalled, live) if over else []

    def _declare(
        self, stalled: list[tuple[RankView, ProgressPhase, int, float]], live: list[RankView]
    ) -> list[HungRank]:
        self.num_hangs += 1
        stopped = {v.pid: process_stopped(v.pid) for v, *_ in stalled}
        dumps = {v.rank: stacks_path(self._run_dir, v.rank) for v, *_ in stalled}
        sizes = {r: _size(p) for r, p in dumps.items()}
        for view, *_ in stalled:
            if not stopped[view.pid]:
                try:
                    os.kill(view.pid, STACK_DUMP_SIGNAL)
                except OSError:
                    stopped[view.pid] = False
        deadline = self._clock() + _DUMP_WAIT_S
        pending = [v.rank for v, *_ in stalled if not stopped[v.pid]]
        while pending and self._clock() < deadline:
            time.sleep(0.05)
            pending = [r for r in pending if _size(dumps[r]) <= sizes[r]]
        if self._moved_on(stalled):
            self.num_hangs -= 1
            log.info("hang_dismissed", ranks=[v.rank for v, *_ in stalled])
            return []
        found = []
        for view, phase, step, idle in stalled:
            frame, waiting = None, phase.waiting
            if not stopped[view.pid]:
                try:
                    text = dumps[view.rank].read_text()[sizes[view.rank] :]
                except OSError:
                    text = ""
                kept = hang_stacks_path(self._run_dir, view.rank, view.pid)
                if text and _write(kept, text):
                    dumps[view.rank] = kept
                threads = parse_stacks(text)
                inner = innermost_frame(threads)
                frame = str(inner) if inner is not None else None
                waiting = waiting or waits_in_collective(threads)
            found.append(
                HungRank(
                    view.rank,
                    view.local_rank,
                    phase,
                    step,
                    idle,
                    stopped[view.pid],
                    frame,
                    waiting,
                )
            )
        # A stopped process explains its peers' stall; else whoever is stuck outside a
        # collective. When every stalled rank waits in a collective the cause is on another
        # node (whose daemon names it): this node names its ranks waiting, and restarts too;
        # with no other node (every rank of the job is here) the collective itself hangs.
        causes = [h for h in found if h.stopped] or [h for h in found if h.cause]
        if not causes and max(v.world_size for v in live) <= len(live):
            causes = found
        unix_s = self._wall_clock()
        reports = []
        for h in found:
            report = HangReport(
                rank=h.rank,
                local_rank=h.local_rank,
                node=self._node,
                phase=h.phase.value,
                step=h.step,
                seconds_without_progress=round(h.idle_s, 1),
                stopped=h.stopped,
                waiting=h.waiting,
                cause=h in causes,
                frame=h.frame,
                stacks=str(dumps[h.rank]),
                unix_s=unix_s,
            )
            reports.append(report)
            log.error(
                "rank_hung" if report.cause else "rank_waiting",
                rank=h.rank,
                node=self._node,
                phase=h.phase.value,
                step=h.step,
                seconds_without_progress=report.seconds_without_progress,
                frame="stopped" if h.stopped else h.frame,
                state="stopped" if h.stopped else "running",
                stacks=report.stacks,
            )
        self.ledger.declare(reports)
        # Every local rank goes: the agent restarts the whole group (a counted restart).
        for view in live:
            self._declared.add(view.pid)
            self._kill(view.pid)
        log.error(
            "hang_restarting_group",
            node=self._node,
            ranks=[v.rank for v in live],
            cause_here=bool(causes),
        )
        return found

    def _moved_on(self, stalled: list[tuple[RankView, ProgressPhase, int, float]]) -> bool:
        """Whether a stalled rank's progress word changed while its stacks were dumped.

        [Note: a stall that ends during the stack dump] Two daemons with the same budget
        declare within moments of each other: the node of a stopped rank kills its group,
        and a peer rank that waited for it in a collective gets an error and unwinds (its
        loop marks `exited` first). Its own daemon, dumping its stacks at that moment, would
        see a running rank outside any collective and name it hung (seen in CI: "in stop" of
        the checkpoint writer, 0.1 s after the other node's restart). A word that moved is
        progress: the declaration is dropped and the next tick looks again.
        """
        moved = False
        for view, *_ in stalled:
            reading = read_progress(progress_path(self._run_dir, view.local_rank))
            last = self._last.get(view.local_rank)
            if reading is not None and last is not None and last[0] != (view.pid, reading.sequence):
                moved = True
        return moved


def _write(path: Path, text: str) -> bool:
    """Keep a hang's dump in its own file ([Note: a hang's stacks outlive the restart])."""
    try:
        path.write_text(text)
    except OSError as err:
        log.warning("hang_stacks_not_kept", path=str(path), error=str(err))
        return False
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
