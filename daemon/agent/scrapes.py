"""When `/metrics` was read, and the wait for one read of the finished state before exit.

[Note: the last scrape must say finished] `TrainingdDaemonDown` leaves out targets whose last
scrape said `trainingd_daemon_finished 1`. A drain of a small job, or a run reaching max_steps,
can end between two scrapes: the target then vanishes with its last report saying "training",
and two minutes later the run pages although it ended on purpose (seen in the dashboards' e2e
test with a 1 s scrape interval: the drained daemon exited in under a second). So a daemon that
ends on purpose keeps serving until one scrape that began after the end has been answered.
It does not wait for a scraper that is not there: never when fewer than two scrapes were seen
(no cadence to judge), and no longer than twice the scraper's own cadence (the median gap of
its recent scrapes) past its last scrape; `final_scrape_wait_s` bounds it all.
"""

from __future__ import annotations

import collections
import enum
import statistics
import threading
import time
from collections.abc import Callable

__all__ = ["FinalScrape", "ScrapeTracker"]

_GAPS_KEPT = 6
"""Recent gaps the cadence is judged from: enough to ride out one slow scrape."""
_MISSED_CADENCES = 2.0
"""A scraper silent for this many of its own intervals is gone."""


class FinalScrape(enum.StrEnum):
    """How the wait for a read of the finished state ended."""

    SERVED = "served"
    """A scrape that began after the end was answered."""
    NEVER_SCRAPED = "never_scraped"
    """Fewer than two scrapes in the daemon's life: nothing to wait for."""
    SCRAPER_GONE = "scraper_gone"
    """No scrape for twice the scraper's cadence: it stopped (or the pod is gone from it)."""
    TIMED_OUT = "timed_out"
    """`final_scrape_wait_s` ran out first."""
    DISABLED = "disabled"
    """`final_scrape_wait_s` is 0."""


class ScrapeTracker:
    """Scrapes of `/metrics` as the HTTP handler threads serve them; thread-safe.

    Args:
        clock: monotonic seconds (tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._last: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=_GAPS_KEPT)
        self._final_served = 0

    def served(self, *, began_finished: bool) -> None:
        """One scrape was answered; `began_finished`: the run had ended when it began."""
        with self._cond:
            now = self._clock()
            if self._last is not None:
                self._gaps.append(now - self._last)
            self._last = now
            if began_finished:
                self._final_served += 1
                self._cond.notify_all()

    def cadence_s(self) -> float | None:
        """The median gap between recent scrapes, or None with fewer than two scrapes."""
        with self._cond:
            return statistics.median(self._gaps) if self._gaps else None

    def wait_for_final(self, limit_s: float) -> FinalScrape:
        """Block until a scrape that began after the end was answered, or it is not coming.

        Call it after the state that scrapes report says finished.
        """
        if limit_s <= 0:
            return FinalScrape.DISABLED
        hard = self._clock() + limit_s
        with self._cond:
            while not self._final_served:
                if self._last is None or not self._gaps:
                    return FinalScrape.NEVER_SCRAPED
                now = self._clock()
                gone_at = self._last + _MISSED_CADENCES * statistics.median(self._gaps)
                if now >= hard:
                    return FinalScrape.TIMED_OUT
                if now >= gone_at:
                    return FinalScrape.SCRAPER_GONE
                # Woken by every final scrape; the deadlines are re-read after each wake.
                self._cond.wait(timeout=min(hard, gone_at) - now)
            return FinalScrape.SERVED
