"""Straggler scores: the window, the score, and the probe's compute time and slots."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from daemon.config import ObservabilitySettings
from daemon.rank.stragglers import MIN_WINDOW_STEPS, StragglerProbe, StragglerWindow, scores_of


def test_no_score_until_the_window_holds_enough_steps_then_median_over_median_rank() -> None:
    window = StragglerWindow(3, max_steps=50, max_age_s=1e9)
    for step in range(MIN_WINDOW_STEPS - 1):
        window.observe([1.0, 1.0, 2.0], now=float(step))
    assert window.scores() == [0.0, 0.0, 0.0]
    assert window.medians() is None
    window.observe([1.0, 1.0, 2.0], now=100.0)
    assert window.scores() == pytest.approx([1.0, 1.0, 2.0])


def test_a_few_slow_steps_do_not_move_a_median_half_the_window_does() -> None:
    window = StragglerWindow(2, max_steps=40, max_age_s=1e9)
    for step in range(40):
        window.observe([1.0, 1.0], now=float(step))
    for step in range(40, 45):  # five hiccups on rank 1
        window.observe([1.0, 5.0], now=float(step))
    assert max(window.scores()) < 1.3
    for step in range(45, 61):  # now over half the window
        window.observe([1.0, 5.0], now=float(step))
    slow = window.scores()[1]
    assert slow == pytest.approx(5.0 / 3.0)  # two ranks: the median rank is their mean
    assert slow >= 1.3


def test_old_rows_leave_the_window_by_count_and_by_age() -> None:
    window = StragglerWindow(1, max_steps=30, max_age_s=10.0)
    for step in range(40):
        window.observe([1.0], now=step * 0.1)
    assert len(window) == 30
    window.observe([1.0], now=100.0)  # every earlier row is older than 10 s
    assert len(window) == 1


def test_scores_of_is_zero_without_a_positive_median_and_checks_the_row_width() -> None:
    assert scores_of([0.0, 0.0, 1.0]) == [0.0, 0.0, 0.0]
    assert scores_of([2.0, 4.0, 6.0]) == pytest.approx([0.5, 1.0, 1.5])
    with pytest.raises(ValueError, match="3 figures for 2 ranks"):
        StragglerWindow(2).observe([1.0, 2.0, 3.0])


@dataclasses.dataclass
class _Totals:
    seconds: float


@dataclasses.dataclass
class _Stats:
    collectives: dict[str, Any]


class _Gauges:
    def __init__(self) -> None:
        self.values: dict[tuple[str, str], float] = {}

    def set(self, name: str, value: float, label: str = "") -> None:
        self.values[(name, label)] = value


def _probe(window_steps: int, gauges: _Gauges, rank: int = 1) -> StragglerProbe:
    settings = ObservabilitySettings(straggler_window_steps=window_steps)
    return StragglerProbe(
        settings, rank=rank, world_size=2, node=3, telemetry=gauges, device=torch.device("cpu")
    )


def test_compute_time_is_the_step_less_the_engines_and_the_timed_waits() -> None:
    gauges = _Gauges()
    probe = _probe(20, gauges)
    # Exported from the start, at 0, the score labelled with the node.
    assert gauges.values == {
        ("trainingd_rank_straggler_score", "3"): 0.0,
        ("trainingd_rank_compute_seconds", ""): 0.0,
    }
    assert probe.slots() == [0.0, 0.0]
    probe.step_done(1.0, _Stats({"all_gather": _Totals(0.25), "reduce_scatter": _Totals(0.25)}))
    assert probe.slots() == [0.0, 0.5]  # its own slot only
    with probe.waiting():
        pass  # a timed wait of ~0 s
    probe.observe([0.0, 0.5])
    probe.step_done(1.0, _Stats({"all_gather": _Totals(0.5), "reduce_scatter": _Totals(0.5)}))
    assert probe.slots()[1] == pytest.approx(0.5, abs=0.01)


def test_the_probe_exports_its_own_score_once_the_window_scores() -> None:
    gauges = _Gauges()
    probe = _probe(20, gauges)
    probe.observe([0.0, 0.0])  # the first step: nobody has a figure
    assert len(probe.window) == 0
    for _ in range(20):
        probe.observe([1.0, 3.0])
    assert gauges.values[("trainingd_rank_straggler_score", "3")] == pytest.approx(1.5)
    assert gauges.values[("trainingd_rank_compute_seconds", "")] == pytest.approx(3.0)


def test_window_zero_turns_the_exchange_off() -> None:
    gauges = _Gauges()
    probe = _probe(0, gauges)
    assert not probe.enabled
    probe.step_done(1.0, _Stats({}))
    assert probe.slots() == []
    probe.observe([])
    assert gauges.values[("trainingd_rank_straggler_score", "3")] == 0.0


def test_2000_noisy_clean_steps_name_nobody() -> None:
    # Equal ranks with a machine's noise: +-30% jitter and a 5x hiccup on 1 step in 20 on any
    # rank (a GC pause, a page fault storm, another process) never reach 1.3 on the median.
    gen = torch.Generator().manual_seed(0)
    window = StragglerWindow(8, max_steps=50, max_age_s=1e9)
    worst = 0.0
    for step in range(2000):
        figures = 0.1 * (0.7 + 0.6 * torch.rand(8, generator=gen, dtype=torch.float64))
        hiccups = torch.rand(8, generator=gen) < 0.05
        figures[hiccups] *= 5.0
        window.observe(figures.tolist(), now=float(step))
        worst = max(worst, *window.scores())
    assert 1.0 < worst < 1.3
