"""Straggler scores: every rank's compute time per step, compared with the median rank's.

[Note: compute time rides on the per-step agreement]
A straggler is a rank whose own work (data, forward, backward, optimizer) takes longer than
its peers'; every other rank then waits for it in the next collective, so wall time per step
is the same everywhere and says nothing. Each rank therefore measures its *compute* time: the
step's time minus what it waited in collectives: the engine's collective waits, counted by
`sharding`'s stats, plus the two blocking all-reduces it does not count, timed here (the
gradient norm's, in `clip_grad_norm_`, with the norm's own small arithmetic; and the
agreement's): on the host around the call on the CPU, with CUDA events on a GPU, read after
the step's one host read, so no extra sync. The figures meet in the all-reduce that already
runs each step ([Note: one all-reduce per step agrees on stop and checkpoint] in `loop.py`):
the agreement tensor gets one slot per rank, each rank writes its previous step's compute
time into its own slot and zeros elsewhere, and the sum is every rank's figure on every rank:
one collective, `world` floats longer. `straggler_window_steps = 0` leaves the slots out
(the overhead benchmark's "off").

`StragglerWindow` keeps the last `straggler_window_steps` rows (none older than
`straggler_window_s`); a rank's score is its median over the window divided by the median over
ranks of those medians (medians interpolate: with two ranks the median rank is their mean).
Each rank exports its own score (`trainingd_rank_straggler_score{node}`) and its median compute
time; the daemon's straggler watch (`daemon/agent/straggler.py`) names a rank whose score is at
or above `straggler_threshold`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from daemon.config import ObservabilitySettings

__all__ = ["MIN_WINDOW_STEPS", "StragglerProbe", "StragglerWindow", "scores_of"]

MIN_WINDOW_STEPS = 20
"""Rows the window needs before it scores (scores are 0 until then; fewer when the window
holds fewer): the first steps of a process (allocation, warm-up) vary too much to judge."""


_SCORE_EVERY = 5
"""The probe scores every this many steps (a tenth of a smaller window): a median over the
window moves slowly, and the sort it costs (~1 ms at 1024 ranks) is then a fifth per step."""


class StragglerWindow:
    """Every rank's compute seconds over the last steps, and each rank's score.

    Args:
        world_size: ranks in the job.
        max_steps: rows kept at most.
        max_age_s: rows older than this are dropped.
        clock: monotonic time source (tests inject one).
    """

    def __init__(
        self,
        world_size: int,
        *,
        max_steps: int = 50,
        max_age_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if world_size < 1 or max_steps < 1 or max_age_s <= 0:
            raise ValueError(
                f"world_size={world_size}, max_steps={max_steps}, max_age_s={max_age_s}: "
                "use positive values"
            )
        self._world = world_size
        self._max_age_s = max_age_s
        self._clock = clock
        # A ring of rows: one copy per step, no allocation (the loop pays for this each step).
        self._rows = torch.zeros(max_steps, world_size, dtype=torch.float64)
        self._times = [-math.inf] * max_steps
        self._next = 0
        self._now = -math.inf
        self._min_rows = min(MIN_WINDOW_STEPS, max_steps)

    def observe(self, compute_s: Sequence[float], now: float | None = None) -> None:
        """Add one step's compute seconds, one per rank in rank order."""
        if len(compute_s) != self._world:
            raise ValueError(f"{len(compute_s)} figures for {self._world} ranks")
        self._now = self._clock() if now is None else now
        self._rows[self._next] = torch.as_tensor(compute_s, dtype=torch.float64)
        self._times[self._next] = self._now
        self._next = (self._next + 1) % len(self._times)

    def _valid(self) -> list[int]:
        return [i for i, t in enumerate(self._times) if self._now - t <= self._max_age_s]

    def __len__(self) -> int:
        return len(self._valid())

    def medians(self) -> list[float] | None:
        """Each rank's median compute seconds over the window; None while it has too few rows."""
        valid = self._valid()
        if len(valid) < self._min_rows:
            return None
        rows = self._rows if len(valid) == len(self._times) else self._rows[valid]
        return [float(v) for v in torch.quantile(rows, 0.5, dim=0)]

    def scores(self) -> list[float]:
        """Each rank's median over the median rank's (0 for every rank while not scoring)."""
        medians = self.medians()
        return [0.0] * self._world if medians is None else scores_of(medians)


def scores_of(medians: Sequence[float]) -> list[float]:
    """Each median over the median of them (all 0 when that is not positive)."""
    middle = float(torch.quantile(torch.tensor(medians, dtype=torch.float64), 0.5))
    if middle <= 0:
        return [0.0] * len(medians)
    return [m / middle for m in medians]


class _Telemetry(Protocol):
    def set(self, name: str, value: float, label: str = "") -> None: ...


class _CollectiveTotals(Protocol):
    @property
    def collectives(self) -> Mapping[str, Any]: ...


class StragglerProbe:
    """One rank's part in straggler detection; the loop calls it around its agreement.

    See [Note: compute time rides on the per-step agreement]. In a step: `waiting()` around
    the gradient norm's all-reduce, `slots()` into the agreement tensor, `waiting()` around
    its all-reduce, `observe()` with the summed slots after the host read, `step_done()` with
    the step's time and the engine's stats.

    Args:
        settings: the `[observability]` section (threshold, window, on or off).
        rank: this rank.
        world_size: ranks in the job.
        node: this rank's node (the daemon's `node_rank`), the score's `node` label.
        telemetry: where the score and compute seconds go.
        device: where the agreement tensor lives (CUDA: the all-reduce is timed with events).
    """

    def __init__(
        self,
        settings: ObservabilitySettings,
        *,
        rank: int,
        world_size: int,
        node: int,
        telemetry: _Telemetry,
        device: torch.device,
    ) -> None:
        self.enabled = settings.straggler_window_steps > 0
        """Whether the compute times are exchanged (`straggler_window_steps` > 0)."""
        self._rank, self._world = rank, world_size
        self._node = str(node)
        self._telemetry = telemetry
        self._cuda = device.type == "cuda"
        self.window = StragglerWindow(
            world_size,
            max_steps=max(settings.straggler_window_steps, 1),
            max_age_s=settings.straggler_window_s,
        )
        """Every rank's compute seconds over the last steps."""
        self._compute_s = 0.0
        self._collective_s = 0.0
        self._wait_s = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._num_observed = 0
        self._score_every = max(1, min(_SCORE_EVERY, settings.straggler_window_steps // 10))
        # Exported from the start, at 0 (nothing measured yet).
        telemetry.set("trainingd_rank_straggler_score", 0.0, self._node)
        telemetry.set("trainingd_rank_compute_seconds", 0.0)

    def slots(self) -> list[float]:
        """This rank's share of the agreement: its last compute time in its own slot."""
        if not self.enabled:
            return []
        values = [0.0] * self._world
        values[self._rank] = self._compute_s
        return values

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time a blocking collective the engine does not count (the agreement, the norm's)."""
        if not self.enabled:
            yield
            return
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            self._events.append((start, end))
        else:
            started = time.perf_counter()
            yield
            self._wait_s += time.perf_counter() - started

    def observe(self, summed: Sequence[float]) -> None:
        """Take every rank's previous compute time (the summed slots, after the host read)."""
        if not self.enabled:
            return
        # The host read waited for the stream past every event: no extra sync.
        for start, end in self._events:
            self._wait_s += start.elapsed_time(end) / 1000.0
        self._events.clear()
        if not any(summed):
            return  # the first step: nobody has a figure yet
        self.window.observe(summed)
        self._num_observed += 1
        if self._num_observed % self._score_every:
            return
        medians = self.window.medians()
        if medians is None:
            return
        score = scores_of(medians)[self._rank]
        self._telemetry.set("trainingd_rank_straggler_score", score, self._node)
        self._telemetry.set("trainingd_rank_compute_seconds", medians[self._rank])

    def step_done(self, step_s: float, stats: _CollectiveTotals) -> None:
        """Derive this step's compute time: `step_s` less the collective waits in it."""
        if not self.enabled:
            return
        total = sum(float(t.seconds) for t in stats.collectives.values())
        waited = total - self._collective_s + self._wait_s
        self._collective_s, self._wait_s = total, 0.0
        self._compute_s = max(step_s - waited, 0.0)
