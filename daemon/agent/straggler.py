"""The straggler watch: names a local rank whose straggler score reaches the threshold.

Each rank exports its own score (`trainingd_rank_straggler_score{node}`, computed in the
training loop from every rank's compute times: [Note: compute time rides on the per-step
agreement] in `daemon/rank/stragglers.py`). The supervisor hands every tick's rank views to
`StragglerWatch.observe`; for each live rank of the current incarnation a score at or above
`straggler_threshold` starts an episode: one `rank_straggler` warning (rank, node, score,
median compute seconds), the rank in the `StragglerLedger` (`daemon/observe/stragglers.py`:
the episodes counter, the status page). A score below it again ends the episode with one
`rank_straggler_recovered` line. With `straggler_action = "restart"` the watch also SIGKILLs
every local rank's process group, as the hang detector does, so the elastic agent restarts the
group (a counted restart); by default it acts on nothing (operators decide).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from daemon._lifecycle import kill_group, pid_alive
from daemon.config import StragglerAction
from daemon.observe.collector import RankView
from daemon.observe.stragglers import StragglerLedger, StragglerReport

__all__ = ["StragglerWatch"]

log = structlog.get_logger("trainingd.straggler")

_SCORE = "trainingd_rank_straggler_score"


class StragglerWatch:
    """Names stragglers among the local ranks from their exported scores.

    Args:
        threshold: `straggler_threshold`.
        action: `straggler_action`.
        ledger: where episodes go for `/metrics` and the status page (a new one if None).
        kill: kills one rank's process group (tests inject one).
        wall_clock: Unix time source (the reports' times).
    """

    def __init__(
        self,
        *,
        threshold: float,
        action: StragglerAction = StragglerAction.NONE,
        ledger: StragglerLedger | None = None,
        kill: Callable[[int], object] = kill_group,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._threshold = threshold
        self._action = action
        self._kill = kill
        self._wall_clock = wall_clock
        self.ledger = ledger if ledger is not None else StragglerLedger()
        """The episodes named here, read by the collector and the status board."""
        self._killed: set[int] = set()
        self.num_restarts = 0
        """Group restarts this watch made (`straggler_action = "restart"`)."""

    def observe(self, views: list[RankView]) -> list[StragglerReport]:
        """Check the live local ranks once.

        Returns:
            The episodes that started now.
        """
        live = [v for v in views if not v.phase.done and pid_alive(v.pid)]
        if not live:
            return []
        newest = max(v.restart for v in live)
        live = [v for v in live if v.restart == newest]
        started = []
        for view in live:
            score, node = _score(view)
            if score >= self._threshold and not self.ledger.straggler(view.rank):
                compute = view.gauge("trainingd_rank_compute_seconds") or 0.0
                report = StragglerReport(
                    rank=view.rank,
                    node=node,
                    score=round(score, 3),
                    compute_s=round(compute, 6),
                    unix_s=self._wall_clock(),
                )
                self.ledger.named(report)
                started.append(report)
                log.warning(
                    "rank_straggler",
                    rank=view.rank,
                    node=node,
                    score=report.score,
                    compute_s=report.compute_s,
                    threshold=self._threshold,
                    action=self._action.value,
                )
            elif score < self._threshold and self.ledger.straggler(view.rank):
                self._recover(view.rank, node, score)
        here = {v.rank for v in live}
        for rank in self.ledger.stragglers():
            if rank not in here:  # its process is gone, or the node now runs other ranks
                self._recover(rank, None, None)
        if started and self._action is StragglerAction.RESTART:
            self._restart(started, live)
        return started

    def _recover(self, rank: int, node: int | None, score: float | None) -> None:
        report = self.ledger.recovered(rank, self._wall_clock())
        if report is not None:
            log.info(
                "rank_straggler_recovered",
                rank=rank,
                node=report.node if node is None or node < 0 else node,
                score=None if score is None else round(score, 3),
                seconds=round((report.recovered_unix_s or report.unix_s) - report.unix_s, 1),
            )

    def _restart(self, started: list[StragglerReport], live: list[RankView]) -> None:
        pids = [v.pid for v in live if v.pid not in self._killed]
        if not pids:
            return
        self.num_restarts += 1
        for report in started:
            self.ledger.mark_restarted(report.rank)
        for pid in pids:
            self._killed.add(pid)
            self._kill(pid)
        log.error(
            "straggler_restarting_group",
            ranks=[v.rank for v in live],
            stragglers=[r.rank for r in started],
        )


def _score(view: RankView) -> tuple[float, int]:
    """The rank's exported score and its node label (0 and -1 before it exported one)."""
    for node, score in view.gauges.get(_SCORE, {}).items():
        return score, int(node) if node.lstrip("-").isdigit() else -1
    return 0.0, -1
