"""Retention invariants under random runs (hypothesis): nothing needed is ever deleted.

A state machine drives the real pieces on a real local root: saves that commit, saves in
flight, failed saves, bit rot of committed steps while the run is down, pins and unpins
(`ckptctl pin`'s confirmed pin), restores (the manager's collective restore with fallback,
with a retention pass landing while a candidate is read), retention passes of the run's
deleter (armed by the run's first restore, as in the manager) and operator prunes (`ckptctl
prune --force`, planned and applied). After every action:

- the newest step that verifies, every pinned step and the step the run restored from are
  still committed (a forced prune does not know the run's restored step, so only the
  deleter's passes are held to that one);
- a step in flight keeps its folder;
- a restore returns the newest step that verifies.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast
from ckpt_manager._coord import Coordinator
from ckpt_manager._format.layout import shard_file_name, step_dir
from ckpt_manager._load.recover import restore_agreed
from ckpt_manager._retention.deleter import Deleter
from ckpt_manager._store.pins import pin_committed_step, unpin_step
from ckpt_manager._store.steps import committed_steps, list_step_dirs
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.prune import apply_prune, plan_prune
from ckpt_manager.ctl.retention import RetentionFlags
from ckpt_manager.errors import CorruptCheckpointError, StepNotFoundError

pytestmark = pytest.mark.slow


class RetentionRun(RuleBasedStateMachine):
    """One run's root under random saves, faults, pins, restores and prunes."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="retention-run-")
        self.storage = Storage(self.dir)
        # The run: saves commit synchronously; its own deleter is replaced by `deleter`.
        cfg = CheckpointConfig(
            async_mode=AsyncMode.SYNC, deletion_retry_s=1e9, uncommitted_grace_s=1e9
        )
        self.manager = CheckpointManager(self.dir, cfg, run_id="prop")
        # Its own deleter would take the model's saves in flight (folders it does not know,
        # below its newest save) for a dead attempt's ([Note: whose leftover]): stop it.
        assert self.manager._deleter is not None
        self.manager._deleter.close(5)
        self.manager._deleter = None
        self.next_step = 1
        self.verified: set[int] = set()  # committed and intact on disk
        self.corrupt: set[int] = set()
        self.pinned: set[int] = set()
        self.inflight: set[int] = set()
        self.restored: int | None = None
        self.choosing: int | None = None
        self.armed = False  # the run's deleter runs passes only once the run has restored
        self.keep_last = 1
        self.deleter = Deleter(
            self.storage,
            KeepLast(n=1),
            saving=lambda: bool(self.inflight),
            protected=self._protected,
            grace_s=0.0,  # failed attempts are collected at once: only saving() guards in-flight
            retry_s=1e9,
            # Retention never waits for a save to settle (deterministic, and the hardest case
            # of [Note: retention is not starved by back-to-back saves]).
            max_defer_s=0.0,
        )  # never armed: passes run only when a rule calls `_pass`

    def _protected(self) -> set[int]:
        return {s for s in (self.restored, self.choosing) if s is not None}

    def teardown(self) -> None:
        self.deleter.close(5)
        self.manager.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _committed(self) -> set[int]:
        return set(committed_steps(self.storage))

    # --- actions --------------------------------------------------------------------------
    @initialize(count=st.integers(1, 3))
    def earlier_saves(self, count: int) -> None:
        for _ in range(count):
            self.save()

    @rule()
    def save(self) -> None:
        step = self.next_step
        self.next_step += 1
        self.manager.save(step, {"w": torch.full((256,), float(step))})
        self.verified.add(step)

    @precondition(lambda self: not self.armed and bool(self.verified))
    @rule(data=st.data())
    def bit_rot_while_the_run_is_down(self, data: st.DataObject) -> None:
        # Newest first: hypothesis favours early elements, and the newest step rotting is
        # the case that matters (retention keeps the newest committed step regardless).
        step = data.draw(st.sampled_from(sorted(self.verified, reverse=True)))
        shard = self.storage.path(f"{step_dir(step)}/{shard_file_name(0)}")
        with open(shard, "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        self.verified.discard(step)
        self.corrupt.add(step)

    @rule()
    def start_save_in_flight(self) -> None:
        step = self.next_step
        self.next_step += 1
        self.storage.write(f"{step_dir(step)}/{shard_file_name(0)}", b"partial")
        self.inflight.add(step)

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data())
    def fail_save_in_flight(self, data: st.DataObject) -> None:
        self.inflight.discard(data.draw(st.sampled_from(sorted(self.inflight))))

    @precondition(lambda self: bool(self.verified | self.corrupt))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.verified | self.corrupt)))
        try:
            pin_committed_step(self.storage, step, confirm_s=0.0)
        except StepNotFoundError:
            assert step not in self._committed()
            return
        self.pinned.add(step)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.pinned)))
        unpin_step(self.storage, step)
        self.pinned.discard(step)

    @rule()
    def restore(self) -> None:
        coord = Coordinator(30.0)

        def choose(step: int) -> None:
            self.choosing = step
            if self.armed:
                self.deleter._pass()  # a retention pass lands while the candidate is read

        result = restore_agreed(
            self.storage, coord, None, None, verify_checksums=True, on_choose=choose
        )
        self.choosing = None
        alive = self.verified & self._committed()
        if not alive:
            assert result is None
            return
        assert result is not None
        assert result.step == max(alive)
        self.restored = result.step
        self.armed = True

    @precondition(lambda self: self.armed)
    @rule(keep_last=st.integers(1, 3))
    def retention_pass(self, keep_last: int) -> None:
        self.deleter._policy = KeepLast(n=keep_last)
        self.deleter._pass()

    @rule(keep_last=st.integers(1, 3))
    def forced_prune(self, keep_last: int) -> None:
        try:
            plan = plan_prune(self.storage, RetentionFlags(keep_last=keep_last))
        except CorruptCheckpointError:
            assert not (self.verified & self._committed())
            return
        for _step, error in apply_prune(self.storage, plan):
            assert error is None or "pinned while the prune ran" in error
        if self.restored is not None and self.restored not in self._committed():
            self.restored = None  # an operator's forced prune does not know the run's step

    # --- what must hold after every action --------------------------------------------------
    @invariant()
    def newest_verified_step_survives(self) -> None:
        committed = self._committed()
        if self.verified:
            assert max(self.verified) in committed, "the newest step that verifies was deleted"
        self.verified &= committed  # older ones may go
        self.corrupt &= committed

    @invariant()
    def pinned_steps_survive(self) -> None:
        assert self.pinned <= self._committed()

    @invariant()
    def restored_step_survives(self) -> None:
        if self.restored is not None:
            assert self.restored in self._committed()

    @invariant()
    def steps_in_flight_keep_their_folder(self) -> None:
        folders = set(list_step_dirs(self.storage))
        assert self.inflight <= folders


TestRetentionInvariants = RetentionRun.TestCase
TestRetentionInvariants.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_prune_keeps_the_newest_step_that_verifies_behind_a_corrupt_newest(
    tmp_path: pathlib.Path,
) -> None:
    # The sequence the state machine looks for, spelled out: steps 1-3, step 3 rots, then an
    # operator prunes to one step. Keeping "the newest" (3) alone would leave nothing restorable.
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((256,), float(step))})
    storage = Storage(str(tmp_path))
    with open(storage.path(f"{step_dir(3)}/{shard_file_name(0)}"), "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\xff")
    plan = plan_prune(storage, RetentionFlags(keep_last=1))
    assert [m.step for m in plan.delete] == [1]
    assert [s for s, _ in plan.keep] == [2]
    assert plan.skipped == [(3, "corrupt: fails verification (kept, untouched)")]
    apply_prune(storage, plan)
    assert committed_steps(storage) == [2, 3]
