"""How often a rank snapshots its state into the memory tier: fixed, or `auto` (adaptive).

`memory_every N` snapshots every N steps (`FixedCadence`). `memory_every auto`
(`AdaptiveCadence`) picks the smallest interval whose amortized snapshot cost stays within
`budget_ratio` (2%) of the step time, as CheckFreq does (Mohan et al., FAST '21): with a
snapshot costing the training thread `c` seconds and a step taking `s`, every `n` steps costs
`c / (n s)` of the run, so the interval is `ceil(c / (budget_ratio x s))`. Both go through
the `Cadence` seam, so the loop asks one object `due(step)` whatever the setting.

[Note: the adaptive interval is smoothed, with hysteresis] Step times and snapshot costs are
noisy (a slow step, a page fault on the first write into a fresh slot), so both are smoothed
(exponential moving averages, weight `smoothing` = 0.1 per measurement), and the interval aims
`headroom` (10%) under the budget: the smallest interval costing at most `(1 - headroom) x
budget_ratio` (1.8%). It moves up to that at once when the interval in force breaks the budget
(a too-frequent snapshot costs every step), and comes down only to an interval costing at most
`(1 - hysteresis) x budget_ratio` (1.6%): between the two thresholds nothing moves, so a cost
wandering around one value moves the interval rarely instead of flapping between neighbours
(with steps +-20% and snapshot costs +-50% around their means, a few changes in 2000 steps,
`tests/daemon/rank/test_memory_cadence.py`). Before `min_steps` step times and one snapshot
cost are known it stays at `initial` (10 steps: cheap whatever the snapshot costs, and it
bounds the steps a restart loses at the start); the first decision takes the aimed interval.

[Note: a snapshot's cost is also measured in the step after it] What the loop can time of a
snapshot is the training thread's stall (the call and the fence wait) and the staging thread's
CPU time ([Note: a snapshot's cost to the step] in `loop.py`). Neither shows what the copy's
memory traffic and the stager's time on a busy core do to the training that runs beside them,
which depends on the machine (its memory bandwidth, its idle cores). As CheckFreq does, the
cadence therefore also measures the snapshot's effect on the step: the step right after a
snapshot (the one its staging runs beside) against the median of the last 15 other steps
("clean"), the difference averaged over snapshots (a plain mean of the first ten, then a moving
average like the others), and counts a snapshot as `stall + max(0, that step's excess)` when
this is more than the fed cost. The fed cost stays the floor: where a spare core takes the
staging, the excess is about 0 and the interval is what it was. On the 2-core VM the two agree
for the 256 MiB job on 2 ranks (fed 19-22 ms; stall 2 ms plus a measured excess of 17-19 ms:
`bench/snapshot_stall.py --ranks 2 --state-mib 256 --memory-every auto`), so there it changes
nothing; `tests/daemon/rank/test_memory_cadence.py` has the case it guards against (fed 3 ms, 9
ms lost: interval 2 and 5% by the fed cost, 5-6 and 2% with the measurement). The step after a
snapshot is the only one compared (two with peer replicas, below): staging that spills into
later steps is in the fed CPU time.
At interval 1 no step is clean; the excess is then taken against the last clean steps (a
reference that aged upwards overstates the excess and lengthens the interval, which brings
clean steps back).

[Note: a replica spills into the step after next] With peer replicas a snapshot is also sent
to the next node once it is complete, and the previous node's arrives at the same steps (every
rank snapshots at the same steps): 134 MB each way for the 256 MiB job, which on the 2-core VM
slowed the step after a snapshot and the one after it (`auto` on 2x1 at `ckpt_every 5`: the
slow steps came in pairs, 0.38-0.56 s against 0.31 s; `bench/results/recovery_big_1x2_2x1_
steps100_warmup60_r2_50a6e99_20261205.json`), and `auto`, measuring the first alone, counted
0.13 s a snapshot where the pair cost about twice that. So with peer replicas (`after_steps=2`)
the excess of a snapshot is that of the two steps after it, summed (the first alone where the
second is a durable save's, or the next snapshot's). Measured after it: the default job on 2x1
at 0.99-1.01x its tier-off mean step, the 256 MiB job at 1.04-1.05x, whose slow steps are not
all `auto`'s (BENCHMARKS.md, "auto and peer replicas").

A durable save snapshots the state into memory too (the durable tier is written from that
snapshot), so the loop tells the cadence of each one (`observe_durable_save`): the interval
counts from it, and neither its cost nor the step after it (its write beside training) is
taken for a memory snapshot's. Before, a memory-only snapshot could follow a durable save at
once, for the same state one step newer.

[Note: under `auto` a durable save between two snapshots stays on its node] Without peer
replicas a durable save's snapshot costs what its staging copy costs with the tier off (the
copy lands in a slot instead of a staging slab), so it is one of `auto`'s snapshots for free.
With peer replicas it would also cost a replica, a send of the rank's state and a receive of
the previous node's, at the durable cadence, not `auto`'s, and unmeasured (the step after a
durable save is left out): on the 2-core VM the 256 MiB job on two nodes x 1 rank at
`ckpt_every 5` stepped 1.07x its tier-off mean under `auto` (the step after each durable save
0.42-0.55 s against 0.31 s). Counting a durable save only where `auto`'s interval had come
due was not enough: with an interval that is a multiple of `ckpt_every`, every counted
snapshot was a durable save, none was measured, `auto` kept its initial 10 steps, and each
replica cost the next step 0.2-0.4 s (1.17x). So with peer replicas (`durable_saves_count=False`)
no durable save is one of `auto`'s snapshots (`counts_durable_save`): each stays on its node
(`save(..., replicate=False)`: a rank restarted here restores it, the replica sender passes
over it), and `auto`'s own snapshots, memory-only and replicated, are measured in the step
after them like any other (with `ckpt_every 0` there, every 25 steps for 1.00x the tier-off
mean: `bench/recovery.py --jobs big --topologies 2x1 --ckpt-every 0`). A fixed
`memory_every N` replicates every snapshot.

[Note: ranks must agree on the interval] A memory step counts only when every rank holds it, so
every rank must snapshot at the same steps. The class is deterministic: fed the same numbers in
the same order, every rank holds the same interval. Feed it values all ranks agree on, e.g. the
step time and the largest snapshot cost over the ranks from the per-step all-reduce, never a
rank's own clock alone.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Protocol

from daemon.config import StepInterval

__all__ = ["AdaptiveCadence", "Cadence", "FixedCadence", "cadence_for"]

_CLEAN_STEPS = 15
"""Clean steps whose median is the reference of the step after a snapshot: a median, so that
a slow step of another kind (the first after the start, an evaluation, a collection) is not
taken for the snapshot's effect."""
_MIN_CLEAN_STEPS = 3
"""Clean steps needed before the step after a snapshot is compared with them."""


class Cadence(Protocol):
    """When the memory tier snapshots: asked each step, told what steps and snapshots cost."""

    @property
    def interval(self) -> int:
        """Steps between two snapshots now (0: never); `trainingd_memory_every_steps`."""
        ...

    def due(self, step: int) -> bool:
        """Whether completed step `step` is snapshotted."""
        ...

    def observe_step(self, step: int, step_s: float) -> None:
        """Completed step `step` took `step_s` seconds (without the fence wait of a snapshot)."""
        ...

    def observe_snapshot(self, step: int, snapshot_s: float, stall_s: float) -> None:
        """The snapshot of step `step` cost `snapshot_s` seconds (the training thread's stall
        plus the staging thread's CPU time), of which `stall_s` the training thread's stall."""
        ...

    def counts_durable_save(self, step: int) -> bool:
        """Whether a durable save at step `step` is one of this cadence's snapshots (its
        snapshot is replicated and the interval counts from it)."""
        ...

    def observe_durable_save(self, step: int, *, counted: bool = True) -> None:
        """A durable save at step `step` also snapshotted the state into memory (`counted`:
        as one of this cadence's snapshots, `counts_durable_save`)."""
        ...


class FixedCadence:
    """`memory_every N`: every N steps (0: never).

    Args:
        every: the interval in steps, 0 or more.

    Raises:
        ValueError: `every` is negative.
    """

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"memory_every={every}: use 0 (off) or more steps")
        self._every = every

    @property
    def interval(self) -> int:
        """The configured interval."""
        return self._every

    def due(self, step: int) -> bool:
        """Every multiple of the interval (never when it is 0)."""
        return self._every > 0 and step % self._every == 0

    def observe_step(self, step: int, step_s: float) -> None:
        """Ignored: a fixed interval does not adapt."""

    def observe_snapshot(self, step: int, snapshot_s: float, stall_s: float) -> None:
        """Ignored: a fixed interval does not adapt."""

    def counts_durable_save(self, step: int) -> bool:
        """Always: every snapshot of a fixed interval is replicated."""
        return True

    def observe_durable_save(self, step: int, *, counted: bool = True) -> None:
        """Ignored: a fixed interval counts from step 0."""


class AdaptiveCadence:
    """`memory_every auto`: the smallest interval costing at most `budget_ratio` of the step
    time ([Note: the adaptive interval is smoothed, with hysteresis]).

    Args:
        budget_ratio: the share of the step time snapshots may cost (0.02: 2%).
        initial: the interval before enough is measured.
        min_steps: step times measured before the first decision.
        smoothing: weight of a new measurement in the moving averages (0 < smoothing <= 1).
        headroom: how far under the budget the chosen interval aims (a share of it).
        hysteresis: how far under the budget (a share of it) an interval must cost for the
            interval to come down to it.
        max_interval: the largest interval it picks (bounds the steps a restart can lose when
            snapshots cost far more than steps).
        durable_saves_count: whether a durable save is one of its snapshots (True: no peer
            replicas; False: [Note: under `auto` a durable save between two snapshots stays
            on its node]).
        after_steps: the steps after a snapshot whose excess over the clean steps is its
            effect (2 with peer replicas: [Note: a replica spills into the step after next]).

    Raises:
        ValueError: a parameter out of range (the message names it).
    """

    def __init__(
        self,
        *,
        budget_ratio: float = 0.02,
        initial: int = 10,
        min_steps: int = 3,
        smoothing: float = 0.1,
        headroom: float = 0.1,
        hysteresis: float = 0.2,
        max_interval: int = 1000,
        durable_saves_count: bool = True,
        after_steps: int = 1,
    ) -> None:
        if not 0 < budget_ratio < 1:
            raise ValueError(f"budget_ratio={budget_ratio}: use a share between 0 and 1")
        if not 1 <= initial <= max_interval:
            raise ValueError(f"initial={initial}: use 1 to max_interval ({max_interval})")
        if min_steps < 1:
            raise ValueError(f"min_steps={min_steps}: use 1 or more")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing={smoothing}: use a weight in (0, 1]")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom={headroom}: use a share in [0, 1)")
        if not 0 <= hysteresis < 1:
            raise ValueError(f"hysteresis={hysteresis}: use a share in [0, 1)")
        if not 1 <= after_steps <= 3:
            raise ValueError(f"after_steps={after_steps}: use 1 to 3 steps")
        self._ratio, self._smoothing, self._hysteresis = budget_ratio, smoothing, hysteresis
        self._aim = budget_ratio * (1 - headroom)
        self._min_steps, self._max = min_steps, max_interval
        self._durable_saves_count = durable_saves_count
        self._interval = initial
        self._step_s: float | None = None
        self._snapshot_s: float | None = None  # as fed: stall + staging CPU
        self._stall_s: float | None = None
        # The recent steps not right after a snapshot, and the moving average of how much
        # longer the step right after one took than their median (with its sample count).
        self._clean_steps: collections.deque[float] = collections.deque(maxlen=_CLEAN_STEPS)
        self._excess_s: float | None = None
        self._excess_samples = 0
        # The excess measured so far after one snapshot: (its step, seconds).
        self._excess: tuple[int, float] | None = None
        self._after_steps = after_steps
        self._unmeasured_step: int | None = None  # after a snapshot whose cost was left out
        self._num_steps = 0
        self._last_snapshot_step: int | None = None
        self._owed = False  # a durable save not counted took the step a snapshot was due at
        self._decided = False

    @property
    def interval(self) -> int:
        """The interval in force."""
        return self._interval

    @property
    def smoothed_step_s(self) -> float | None:
        """The moving average of the step time (None before the first)."""
        return self._step_s

    @property
    def smoothed_snapshot_s(self) -> float | None:
        """What a snapshot costs by the averages now: the fed cost, or the stall plus the
        measured excess of the step after it where that is more ([Note: a snapshot's cost is
        also measured in the step after it]); None before the first snapshot."""
        if self._snapshot_s is None:
            return None
        if self._excess_s is None or self._stall_s is None:
            return self._snapshot_s
        return max(self._snapshot_s, self._stall_s + max(self._excess_s, 0.0))

    @property
    def smoothed_excess_s(self) -> float | None:
        """The moving average of how much longer the step right after a snapshot takes than
        the other steps (None before it is measured)."""
        return self._excess_s

    def due(self, step: int) -> bool:
        """`interval` steps after the last snapshot (the first at a multiple of it), or since
        a durable save that was not counted took the step it came due at."""
        if self._owed:
            return True
        if self._last_snapshot_step is None:
            return step % self._interval == 0
        return step - self._last_snapshot_step >= self._interval

    def observe_step(self, step: int, step_s: float) -> None:
        """Fold in the time of completed step `step`; re-evaluate the interval.

        The step right after a snapshot's step is compared with the clean ones ([Note: a
        snapshot's cost is also measured in the step after it]); the others are clean.
        """
        if not math.isfinite(step_s) or step_s <= 0:
            return
        self._step_s = self._average(self._step_s, step_s)
        self._num_steps += 1
        last = self._last_snapshot_step
        if step == self._unmeasured_step:
            # Beside a one-time cost ([Note: a slot's allocation is not a snapshot's cost]) or
            # a durable save's write: what the steps before it measured stands alone.
            self._fold_excess()
        elif last is not None and last < step <= last + self._after_steps:
            if step == last + 1:
                self._fold_excess()  # an older snapshot's window, cut short by this one
                if len(self._clean_steps) >= _MIN_CLEAN_STEPS:
                    self._excess = (last, 0.0)
            if self._excess is not None and self._excess[0] == last:
                reference = statistics.median(self._clean_steps)
                self._excess = (last, self._excess[1] + step_s - reference)
                if step == last + self._after_steps:
                    self._fold_excess()
        else:
            self._fold_excess()
            self._clean_steps.append(step_s)
        self._decide()

    def _fold_excess(self) -> None:
        """Average in the excess measured after the last snapshot, if any."""
        if self._excess is None:
            return
        excess = self._excess[1]
        self._excess = None
        self._excess_samples += 1
        # The first samples are averaged plainly: an average that starts at its first sample
        # would carry it for some 20 snapshots, hundreds of steps apart.
        weight = max(self._smoothing, 1 / self._excess_samples)
        previous = excess if self._excess_s is None else self._excess_s
        self._excess_s = previous + weight * (excess - previous)

    def observe_snapshot(self, step: int, snapshot_s: float, stall_s: float) -> None:
        """Fold in one snapshot's cost and stall (and remember its step); re-evaluate.

        A non-finite cost (a snapshot that paid a one-time cost, as its slot's allocation) is
        left out, and so is the step after it.
        """
        self._fold_excess()
        self._last_snapshot_step, self._owed = step, False
        if not (math.isfinite(snapshot_s) and math.isfinite(stall_s)):
            self._unmeasured_step = step + 1
            return
        if snapshot_s < 0 or stall_s < 0:
            return
        self._snapshot_s = self._average(self._snapshot_s, snapshot_s)
        self._stall_s = self._average(self._stall_s, stall_s)
        self._decide()

    def counts_durable_save(self, step: int) -> bool:
        """Every durable save without peer replicas, none with them ([Note: under `auto` a
        durable save between two snapshots stays on its node])."""
        return self._durable_saves_count

    def observe_durable_save(self, step: int, *, counted: bool = True) -> None:
        """A durable save at `step` snapshotted the state into memory too. `counted`: the
        interval counts from it (a memory-only snapshot right after it would hold the same
        state one step newer, for the same cost). Its cost is a durable save's, not a memory
        snapshot's: left out, and so is the step after it, which its write runs beside."""
        if counted:
            self._last_snapshot_step, self._owed = step, False
        elif self.due(step):
            self._owed = True  # the snapshot due here comes at the next step
        self._unmeasured_step = step + 1

    def cost_ratio(self, interval: int) -> float | None:
        """Amortized snapshot cost of `interval` as a share of the step time (None: unknown)."""
        cost = self.smoothed_snapshot_s
        if self._step_s is None or cost is None:
            return None
        return cost / (interval * self._step_s)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._smoothing * (new - old)

    def aimed_interval(self) -> int | None:
        """The smallest interval costing at most the aimed share, by the averages now (None:
        not measured yet)."""
        if self._step_s is None or self._snapshot_s is None:
            return None
        return self._smallest_within(self._aim)

    def _smallest_within(self, ratio: float) -> int:
        cost = self.smoothed_snapshot_s
        assert self._step_s is not None
        assert cost is not None
        # The tolerance keeps an exact fit (cost == ratio) from rounding one step up.
        need = math.ceil(cost / (ratio * self._step_s) - 1e-9)
        return min(max(need, 1), self._max)

    def _decide(self) -> None:
        aimed = self.aimed_interval()
        cost = self.cost_ratio(self._interval)
        if aimed is None or cost is None or self._num_steps < self._min_steps:
            return
        if not self._decided or cost > self._ratio:
            self._interval, self._decided = aimed, True
            return
        lower = self._smallest_within(self._ratio * (1 - self._hysteresis))
        self._interval = min(self._interval, lower)


def cadence_for(setting: StepInterval, *, peer_replicas: bool = False) -> Cadence:
    """The cadence of a `memory_every` setting: `FixedCadence`, or `AdaptiveCadence` for auto.

    Args:
        setting: `CheckpointSettings.memory_every` as the daemon handed it (0 when `auto`
            could not fit this node).
        peer_replicas: the next node holds replicas of this node's snapshots
            (`DaemonConfig.num_memory_replicas`).
    """
    if setting.steps is None:
        if peer_replicas:
            return AdaptiveCadence(durable_saves_count=False, after_steps=2)
        return AdaptiveCadence()
    return FixedCadence(setting.steps)
