"""The wait for one scrape of the finished state before a daemon that ended on purpose exits."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.agent.http import MetricsServer
from daemon.agent.scrapes import FinalScrape, ScrapeTracker
from daemon.observe.collector import NodeCollector, SnapshotAggregator, make_registry
from daemon.observe.state import NodePhase, NodeState


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[MetricsServer, NodeState]]:
    state = NodeState(local_ranks=1)
    collector = NodeCollector(SnapshotAggregator(tmp_path, 1), state, {"version": "t"}, run_id="t")
    server = MetricsServer(
        make_registry(collector), state, lambda: [], heartbeat_timeout_s=60, port=0
    ).start()
    yield server, state
    server.close()


def _finished(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "trainingd_daemon_finished":
            return float(family.samples[0].value)
    raise AssertionError("no trainingd_daemon_finished in /metrics")


class _Scraper:
    """A scraper like Prometheus: reads /metrics every `interval_s` until stopped."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.seen: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.seen.append(_finished(self.url))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_an_ended_run_waits_until_a_scrape_has_read_finished(
    node: tuple[MetricsServer, NodeState],
) -> None:
    server, state = node
    url = f"http://127.0.0.1:{server.port}/metrics"
    state.update(phase=NodePhase.TRAINING)
    with _Scraper(url, interval_s=0.5) as scraper:
        while len(scraper.seen) < 3:  # the scraper's cadence is known
            time.sleep(0.05)
        state.update(phase=NodePhase.STOPPED)
        # A limit no slow machine reaches: only the final scrape may end the wait.
        assert server.scrapes.wait_for_final(600.0) is FinalScrape.SERVED
    # The wait ended once a reply saying finished had gone out (the scraper parses it after;
    # the context's exit joins it): the scraper read finished before the daemon could exit.
    assert scraper.seen[0] == 0.0
    assert 1.0 in scraper.seen


def test_nothing_to_wait_for_without_a_scraper(node: tuple[MetricsServer, NodeState]) -> None:
    server, state = node
    state.update(phase=NodePhase.STOPPED)
    started = time.monotonic()
    assert server.scrapes.wait_for_final(600.0) is FinalScrape.NEVER_SCRAPED
    assert time.monotonic() - started < 60  # returned at once, not after the limit
    assert server.scrapes.wait_for_final(0.0) is FinalScrape.DISABLED


def test_a_scraper_that_went_away_is_not_waited_for(
    node: tuple[MetricsServer, NodeState],
) -> None:
    server, state = node
    url = f"http://127.0.0.1:{server.port}/metrics"
    for _ in range(3):  # an ad-hoc reader (curl, a test), not a running Prometheus
        assert _finished(url) == 0.0
    cadence = server.scrapes.cadence_s()
    assert cadence is not None
    state.update(phase=NodePhase.STOPPED)
    assert server.scrapes.wait_for_final(600.0) is FinalScrape.SCRAPER_GONE


def test_the_limit_bounds_a_slow_scraper() -> None:
    offset = [0.0]
    tracker = ScrapeTracker(clock=lambda: time.monotonic() + offset[0])
    for at in (0.0, 30.0, 60.0):  # one scrape every 30 s, the last one just now
        offset[0] = at
        tracker.served(began_finished=False)
    assert tracker.cadence_s() == pytest.approx(30.0, abs=1.0)
    assert tracker.wait_for_final(0.2) is FinalScrape.TIMED_OUT


def test_only_a_scrape_begun_after_the_end_ends_the_wait() -> None:
    offset = [0.0]
    tracker = ScrapeTracker(clock=lambda: time.monotonic() + offset[0])
    for at in (0.0, 30.0, 60.0):
        offset[0] = at
        tracker.served(began_finished=False)
    # One scrape that was in flight when the run ended, then one that began after it.
    threading.Timer(0.1, lambda: tracker.served(began_finished=False)).start()
    threading.Timer(0.4, lambda: tracker.served(began_finished=True)).start()
    started = time.monotonic()
    assert tracker.wait_for_final(600.0) is FinalScrape.SERVED
    assert time.monotonic() - started >= 0.35
