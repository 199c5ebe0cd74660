"""Multi-rank saves on real gloo ranks: every mode, resharding, failures reaching every rank."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import threading
import time
from typing import Any, NamedTuple

import pytest
import torch

from ckpt_manager import (
    AsyncMode,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    MemoryTierConfig,
    RankLocal,
    SaveFailedError,
)
from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._format.manifest import FORMAT_VERSION
from ckpt_manager._save.finalize import AGREE_POLL_S, OWN_WRITE_POLL_S
from ckpt_manager._save.writer import FAULT_ENV
from ckpt_manager._store.indexes import complete_manifest
from ckpt_manager._store.steps import read_manifest
from ckpt_manager._store.storage import Storage
from tests.ckpt_manager.conftest import Shard
from tests.support.agreement_rounds import counting_agreement_rounds
from tests.support.dist import ParentState, _child, group_store, rank_context, run_on_ranks

pytestmark = pytest.mark.slow

FLAT_SHAPE = (5, 7)  # 35 elements, split in flat ranges
BOX_SHAPE = (6, 4)  # split by rows


def _flat_range(rank: int, world: int) -> tuple[int, int]:
    numel = FLAT_SHAPE[0] * FLAT_SHAPE[1]
    per = -(-numel // world)
    return min(numel, rank * per), min(numel, (rank + 1) * per)


def _rows(rank: int, world: int) -> tuple[int, int]:
    per = -(-BOX_SHAPE[0] // world)
    return min(BOX_SHAPE[0], rank * per), min(BOX_SHAPE[0], (rank + 1) * per)


def _full(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.arange(35, dtype=torch.float32).reshape(FLAT_SHAPE) * (step + 1)
    box = torch.arange(24, dtype=torch.float64).reshape(BOX_SHAPE) - step
    return flat, box


def _rank_state(rank: int, world: int, version: int) -> dict[str, Any]:
    """This rank's view of the state after `version` optimizer steps."""
    flat, box = _full(version)
    a, b = _flat_range(rank, world)
    r0, r1 = _rows(rank, world)
    return {
        "model": {
            "flat": Shard(flat.reshape(-1)[a:b].clone(), FLAT_SHAPE, (0, 0), (a, b)),
            "box": Shard(box[r0:r1].clone(), BOX_SHAPE, (r0, 0)),
            "replicated": torch.full((3,), float(version)),
        },
        "sched": {"last_epoch": version},
        "rng": RankLocal({"seed": torch.tensor([rank * 100 + version]), "pos": rank}),
    }


def _optimizer_step(state: dict[str, Any], rank: int, world: int, version: int) -> None:
    """Mutate in place to the next version, like optimizer.step()."""
    nxt = _rank_state(rank, world, version)
    state["model"]["flat"].local.copy_(nxt["model"]["flat"].local)
    state["model"]["box"].local.copy_(nxt["model"]["box"].local)
    state["model"]["replicated"].copy_(nxt["model"]["replicated"])
    state["sched"]["last_epoch"] = version
    state["rng"].value["seed"].copy_(nxt["rng"].value["seed"])


def _check(
    restored: dict[str, Any], rank: int, world: int, version: int, *, saved_world: int, kept: int
) -> None:
    """Compare with version `version`; RankLocal of ranks absent when saved keep version `kept`."""
    want = _rank_state(rank, world, version)
    for key in ("flat", "box"):
        assert torch.equal(restored["model"][key].local, want["model"][key].local), key
    assert torch.equal(restored["model"]["replicated"], want["model"]["replicated"])
    assert restored["sched"]["last_epoch"] == version
    seed_version = version if rank < saved_world else kept
    assert restored["rng"]["seed"].item() == rank * 100 + seed_version


def _modes_on_ranks(rank: int, world: int, root: str, memory: str | None = None) -> list[str]:
    """Every mode: three saves, each restored; with `memory`, the memory tier on (every
    durable file is then written from a memory slot)."""
    done = []
    for mode in AsyncMode:
        tier = None
        if memory is not None:
            os.makedirs(f"{memory}/{mode.value}", exist_ok=True)
            tier = MemoryTierConfig(f"{memory}/{mode.value}")
        cfg = CheckpointConfig(async_mode=mode, finalize_timeout_s=60, memory=tier)
        state = _rank_state(rank, world, 0)
        with CheckpointManager(f"{root}/{mode.value}", cfg, run_id="multi") as mgr:
            for step in range(3):
                mgr.save(step, state, metrics={"step": step})
                time.sleep(0.01)  # "forward/backward" overlapping the snapshot copy
                mgr.before_optimizer_step()
                _optimizer_step(state, rank, world, step + 1)  # mutate right after the fence
                mgr.maybe_finalize()
            mgr.wait_until_finished()
            assert mgr.all_steps() == [0, 1, 2], mode
            assert mgr.stats().num_memory_snapshots == (0 if memory is None else 3), mode
            for step in range(3):
                template = _rank_state(rank, world, 99)
                result = mgr.restore(step, into=template)
                assert result is not None
                _check(result.state, rank, world, step, saved_world=world, kept=99)
        done.append(mode.value)
    return done


def _modes_then_reshard(rank: int, world: int, root: str, saved_at_2: str) -> list[str]:
    """At 3 ranks: every mode, then restore the 2-rank checkpoint resharded to 3."""
    done = _modes_on_ranks(rank, world, root)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(saved_at_2, cfg, run_id="reshard") as mgr:
        template = _rank_state(rank, world, 0)
        result = mgr.restore(into=template)
        assert result is not None
        assert result.step == 2
        _check(result.state, rank, world, 2, saved_world=2, kept=0)
    return [*done, "resharded"]


def _two_rank_scenarios(rank: int, world: int, modes_root: str, fault_root: str) -> Any:
    """The 2-rank scenarios in one spawn (spawning ranks costs more than any scenario)."""
    modes = _modes_on_ranks(rank, world, modes_root)
    # The same with the memory tier on: the durable files come from the memory slots.
    with_memory = _modes_on_ranks(rank, world, f"{fault_root}-memory", f"{fault_root}-shm")
    fault = _writer_fault_on_rank1(rank, world, fault_root)
    conflict = _commit_conflict(rank, world, fault_root)
    straggler = _straggler_on_rank1(rank, world, fault_root)
    opening = _opening_rounds(rank, world, fault_root)
    late = _late_peer(rank, world, fault_root)  # last: it leaves one group timed out
    return {
        "modes": modes,
        "modes_with_memory": with_memory,
        "fault": fault,
        "conflict": conflict,
        "straggler": straggler,
        "opening": opening,
        "late": late,
    }


class _TwoRanks(NamedTuple):
    modes_root: pathlib.Path
    fault_root: pathlib.Path
    out: list[Any]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> _TwoRanks:
    """One 2-rank run: every mode (then resharded to 3), a writer fault, a commit conflict."""
    base = tmp_path_factory.mktemp("two-ranks")
    modes_root, fault_root = base / "two", base / "fault"
    out = run_on_ranks(_two_rank_scenarios, 2, str(modes_root), str(fault_root), timeout_s=300)
    return _TwoRanks(modes_root, fault_root, out)


def test_every_mode_at_2_and_3_ranks_and_resharding(
    two_ranks: _TwoRanks, tmp_path: pathlib.Path
) -> None:
    two, three = two_ranks.modes_root, tmp_path / "three"
    assert [o["modes"] for o in two_ranks.out] == [[m.value for m in AsyncMode]] * 2
    assert [o["modes_with_memory"] for o in two_ranks.out] == [[m.value for m in AsyncMode]] * 2
    saved_at_2 = str(two / AsyncMode.PERSISTENT.value)
    out = run_on_ranks(_modes_then_reshard, 3, str(three), saved_at_2, timeout_s=240)
    assert out == [[*(m.value for m in AsyncMode), "resharded"]] * 3
    for root, world in ((two, 2), (three, 3)):
        storage = Storage(str(root / "persistent"))
        manifest = json.loads(storage.read(f"{step_dir(2)}/{MANIFEST_NAME}"))
        assert manifest["format_version"] == FORMAT_VERSION
        assert manifest["world_size"] == world
        assert manifest["tensors"]["model/flat"]["ranks"] == [[0, world]]
        assert manifest["tensors"]["model/replicated"]["ranks"] == [[0, 1]]
        full = complete_manifest(storage, read_manifest(storage, 2))
        assert len(full.tensors["model/flat"]["pieces"]) == world
        assert len(full.tensors["model/replicated"]["pieces"]) == 1
        assert len(full.rank_local) == world
    # One process, no template: sharded tensors come back whole (what ckptctl restore does).
    with CheckpointManager(saved_at_2, CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        result = mgr.restore()
    assert result is not None
    flat, box = _full(2)
    assert torch.equal(result.state["model"]["flat"], flat)
    assert torch.equal(result.state["model"]["box"], box)
    assert result.state["rng"] == {"seed": torch.tensor([2]), "pos": 0}


def _writer_fault_on_rank1(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ[FAULT_ENV] = "raise@2@1"
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, finalize_timeout_s=20)
    with CheckpointManager(root, cfg, run_id="fault") as mgr:
        mgr.save(1, _rank_state(rank, world, 1))
        mgr.wait_until_finished()
        mgr.save(2, _rank_state(rank, world, 2))
        t0 = time.monotonic()
        error = ""
        try:
            for _ in range(2000):
                mgr.maybe_finalize()
                time.sleep(0.01)
        except SaveFailedError as err:
            error = str(err)
        elapsed = time.monotonic() - t0
        mgr.save(3, _rank_state(rank, world, 3))  # training continues; the next save works
        mgr.wait_until_finished()
        return {"error": error, "elapsed": elapsed, "steps": mgr.all_steps()}


def _straggler_on_rank1(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1's writer takes 3 s, past the group's collective timeout (2 s); counts the
    agreement rounds (every rank issues the same ones)."""
    os.environ[FAULT_ENV] = "stall=3@5@1"
    cfg = CheckpointConfig(
        async_mode=AsyncMode.PERSISTENT, max_inflight=1, finalize_timeout_s=2, write_timeout_s=60
    )
    started = time.monotonic()
    with counting_agreement_rounds() as count:
        try:
            with CheckpointManager(root + "-straggler", cfg, run_id="straggler") as mgr:
                mgr.save(5, _rank_state(rank, world, 5))
                mgr.save(6, _rank_state(rank, world, 6))  # back-pressure: waits for step 5
                mgr.wait_until_finished()  # the final drain
                steps, error = mgr.all_steps(), ""
        except CheckpointError as err:
            steps, error = [], f"{type(err).__name__}: {err}"
        finally:
            del os.environ[FAULT_ENV]
    return {
        "steps": steps,
        "error": error,
        "rounds": count.rounds,
        "elapsed_s": time.monotonic() - started,
    }


def _opening_rounds(rank: int, world: int, root: str) -> dict[str, Any]:
    """`wait_until_finished()` right after `save()`, both writers held until a file appears
    (rank 0 makes it shortly after): the agreement rounds that took. The pauses between
    rounds are raised so that only news ends them, whatever the machine's speed."""
    from ckpt_manager._save import finalize

    hold = f"{root}-opening-hold"
    os.environ[FAULT_ENV] = f"hold={hold}@7"
    saved = finalize.OWN_WRITE_POLL_S, finalize.AGREE_POLL_S
    finalize.OWN_WRITE_POLL_S = finalize.AGREE_POLL_S = 5.0
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, finalize_timeout_s=60)
    try:
        with (
            counting_agreement_rounds() as count,
            CheckpointManager(root + "-opening", cfg, run_id="opening") as mgr,
        ):
            mgr.save(7, _rank_state(rank, world, 7))
            if rank == 0:
                release = threading.Timer(0.3, pathlib.Path(hold).touch)
                release.start()
            mgr.wait_until_finished()
            return {"steps": mgr.all_steps(), "rounds": count.rounds}
    finally:
        del os.environ[FAULT_ENV]
        finalize.OWN_WRITE_POLL_S, finalize.AGREE_POLL_S = saved


_FOREIGN_MANIFEST = b'{"run_id": "other-launch"}'


def _commit_conflict(rank: int, world: int, root: str) -> dict[str, Any]:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(root + "-conflict", cfg, run_id="conflict") as mgr:
        if rank == 0:  # another launch commits step 5 before this run's commit of it
            mgr.storage.write(f"{step_dir(5)}/{MANIFEST_NAME}", _FOREIGN_MANIFEST)
        got: list[str] = []
        try:
            mgr.save(5, _rank_state(rank, world, 5))
        except SaveFailedError as err:
            cause = err.__cause__
            got = [type(err).__name__, type(cause).__name__, getattr(cause, "other_run_id", "")]
        mgr.save(6, _rank_state(rank, world, 6))  # training continues; the next save works
        return {"error": got, "steps": mgr.all_steps()}


def test_commit_conflict_raises_the_same_error_on_every_rank_and_keeps_the_folder(
    two_ranks: _TwoRanks,
) -> None:
    for rank_out in (o["conflict"] for o in two_ranks.out):
        assert rank_out["error"] == ["SaveFailedError", "CommitConflictError", "other-launch"]
        assert rank_out["steps"] == [5, 6]
    root = pathlib.Path(f"{two_ranks.fault_root}-conflict")
    assert (root / step_dir(5) / MANIFEST_NAME).read_bytes() == _FOREIGN_MANIFEST


def test_writer_exception_reaches_every_rank(two_ranks: _TwoRanks) -> None:
    for rank_out in (o["fault"] for o in two_ranks.out):
        assert "step 2 failed: rank 1: writer failed: RuntimeError: injected" in rank_out["error"]
        assert rank_out["elapsed"] < 20
        assert rank_out["steps"] == [1, 3]
    assert not (two_ranks.fault_root / step_dir(2)).exists()


def test_a_writer_slower_than_the_collective_timeout_commits(two_ranks: _TwoRanks) -> None:
    # [Note: a blocking finalize polls the agreement]: only write_timeout_s bounds a write.
    for rank_out in (o["straggler"] for o in two_ranks.out):
        assert {k: rank_out[k] for k in ("steps", "error")} == {"steps": [5, 6], "error": ""}
    # While rank 1 is still writing (3 s), rounds come every OWN_WRITE_POLL_S (0.25 s) at most,
    # not every AGREE_POLL_S (0.05 s): 20 rounds in all for the two saves on a quiet machine, 69
    # before. The rest of the time (staging, commit: longer on a loaded machine) may poll at
    # AGREE_POLL_S, so the bound grows with it, and a 0.05 s poll through the write exceeds it.
    rounds = [o["straggler"]["rounds"] for o in two_ranks.out]
    elapsed = max(o["straggler"]["elapsed_s"] for o in two_ranks.out)
    assert rounds[0] == rounds[1]
    bound = 3 / OWN_WRITE_POLL_S + max(elapsed - 3, 0) / AGREE_POLL_S + 8
    assert rounds[0] <= bound, f"{rounds[0]} agreement rounds for two saves in {elapsed:.1f} s"


def test_a_blocking_finalize_opens_each_phase_once_its_own_part_can_end_it(
    two_ranks: _TwoRanks,
) -> None:
    # [Note: a blocking finalize opens a phase once its own part can end it]: one AGREE round
    # once both writes are done, one COMMIT round once the commit is (the reports' gather is
    # not a poll round); before, AGREE opened while the writes were held and COMMIT as the
    # commit was queued: 4 rounds or more.
    for rank_out in (o["opening"] for o in two_ranks.out):
        assert rank_out == {"steps": [7], "rounds": 2}


# --- [Note: a non-blocking finalize never waits for a peer] ---------------------------------

LATE_CALLS = 20
"""`maybe_finalize` calls rank 0 makes while rank 1 takes no part."""


def _wait_for(path: pathlib.Path) -> None:
    deadline = time.monotonic() + 60  # a hang guard, never reached
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _poll_until_failure(mgr: CheckpointManager) -> tuple[int, str]:
    """`maybe_finalize` until it raises; the calls made and the error."""
    for calls in range(100_000):  # far beyond the timeout's worth: the timeout ends it first
        try:
            mgr.maybe_finalize()
        except SaveFailedError as err:
            return calls, str(err)
        time.sleep(0.005)
    raise AssertionError("an unanswered poll never failed the save")


def _late_peer(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1 joins the finalize only after rank 0 made `LATE_CALLS` calls; then it commits.
    Then rank 1 never joins a second save's finalize: rank 0's polls fail it within the
    finalize timeout."""
    signals = pathlib.Path(root + "-late-signals")
    signals.mkdir(exist_ok=True)
    out: dict[str, Any] = {}
    # A blocking poll would sit in the all-reduce for rank 1 until this timeout ran out.
    cfg = CheckpointConfig(finalize_timeout_s=2)
    with CheckpointManager(root + "-late", cfg, run_id="late-peer") as mgr:
        mgr.save(1, _rank_state(rank, world, 1))
        mgr.before_optimizer_step()
        if rank == 0:
            for _ in range(LATE_CALLS):
                mgr.maybe_finalize()
            out["calls"] = len(mgr.stats().recent_finalize_call_s)
            out["inflight_while_late"] = mgr.stats().inflight
            (signals / "go").touch()
        else:
            _wait_for(signals / "go")  # stands for a rank stopped or busy in a long step
        mgr.wait_until_finished()
        out["steps"] = mgr.all_steps()
        mgr.save(2, _rank_state(rank, world, 2))
        mgr.before_optimizer_step()
        if rank == 0:
            out["absent"] = _poll_until_failure(mgr)
            out["inflight_after_failure"] = mgr.stats().inflight
            (signals / "failed").touch()
        else:
            _wait_for(signals / "failed")
            try:
                mgr.wait_until_finished()
            except SaveFailedError as err:
                out["absent"] = (0, str(err))
    return out


def test_maybe_finalize_returns_while_a_peer_is_late_and_fails_past_the_timeout(
    two_ranks: _TwoRanks,
) -> None:
    rank0, rank1 = (o["late"] for o in two_ranks.out)
    # Every call returned although rank 1 issued no collective meanwhile; the save waited,
    # and committed once rank 1 joined.
    assert rank0["calls"] == LATE_CALLS
    assert rank0["inflight_while_late"] == 1
    assert rank0["steps"] == rank1["steps"] == [1]
    # An unanswered poll still fails the save (on the training thread's next calls) once
    # the finalize timeout has passed: after many calls, never a hang. The late rank's own
    # finalize of that save fails too.
    calls, error = rank0["absent"]
    assert calls > 1
    assert "step 2" in error
    assert "did not complete within 2 s" in error
    assert rank0["inflight_after_failure"] == 0
    assert "step 2" in rank1["absent"][1]


def _rank1_dies_mid_save(rank: int, world: int, root: str, report: str) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, finalize_timeout_s=15)
    mgr = CheckpointManager(root, cfg, run_id="die")
    mgr.save(1, _rank_state(rank, world, 1))
    mgr.wait_until_finished()
    mgr.save(2, _rank_state(rank, world, 2))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _report_outcome(mgr.wait_until_finished, report, mgr)
    mgr.close()


def _run_with_a_dying_rank(fn: Any, root: pathlib.Path, report: pathlib.Path) -> list[int | None]:
    """Run `fn(rank, 2, root, report)` on 2 spawned ranks, one of which SIGKILLs itself;
    wait for the survivor's report and return the exit codes."""
    ctx = rank_context()
    results = ctx.Queue()
    store = group_store(2)  # [Note: the parent holds the group's port]
    port = store.port
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                rank,
                2,
                port,
                (str(root), str(report)),
                ParentState(),
                1,
                results,
                "gloo",
                60.0,
            ),
            daemon=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert report.exists(), "the surviving rank did not report within 120 s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        try:
            while True:
                results.get_nowait()
        except queue.Empty:
            pass
    return [p.exitcode for p in procs]


def _report_outcome(call: Any, report: str, mgr: Any = None) -> None:
    """Run `call()` on the surviving rank and write what happened (error, time, steps)."""
    t0 = time.monotonic()
    outcome: dict[str, Any] = {"error": "", "type": ""}
    try:
        call()
    except CheckpointError as err:
        outcome = {"error": str(err), "type": type(err).__name__}
    outcome["elapsed"] = time.monotonic() - t0
    if mgr is not None:
        outcome["steps"] = mgr.all_steps()
    pathlib.Path(report).write_text(json.dumps(outcome))


def _kill_self_on(call: str, matches: Any) -> None:
    """SIGKILL this process at the first `Storage.<call>(name)` whose name matches: a rank
    dying at an exact point of a commit or a restore (the kill itself is a real SIGKILL)."""
    from ckpt_manager._store.storage import Storage

    real = getattr(Storage, call)

    def dying(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if matches(name):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, name, *args, **kwargs)

    setattr(Storage, call, dying)


def _coordinator_dies_mid_commit(rank: int, world: int, root: str, report: str) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, finalize_timeout_s=10)
    mgr = CheckpointManager(root, cfg, run_id="coord-dies")
    mgr.save(1, _rank_state(rank, world, 1))
    mgr.wait_until_finished()
    if rank == 0:  # dies with every shard of step 2 written, as it writes the manifest
        _kill_self_on("write", lambda name: name == f"{step_dir(2)}/{MANIFEST_NAME}")
    mgr.save(2, _rank_state(rank, world, 2))
    _report_outcome(mgr.wait_until_finished, report, mgr)


def test_coordinator_killed_mid_commit_fails_the_step_on_the_others(
    tmp_path: pathlib.Path,
) -> None:
    root, report = tmp_path / "root", tmp_path / "rank1.json"
    codes = _run_with_a_dying_rank(_coordinator_dies_mid_commit, root, report)
    outcome = json.loads(report.read_text())
    assert codes[0] == -signal.SIGKILL
    assert outcome["type"] in ("SaveFailedError", "CheckpointTimeoutError", "CheckpointError")
    assert outcome["elapsed"] < 10 + 10  # finalize_timeout_s plus slack, never a hang
    assert outcome["steps"] == [1]  # nothing half-committed is listed
    assert not (root / step_dir(2) / MANIFEST_NAME).exists()


def _rank1_dies_during_restore(rank: int, world: int, root: str, report: str) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, finalize_timeout_s=10)
    mgr = CheckpointManager(root, cfg, run_id="restore-dies")
    mgr.save(1, _rank_state(rank, world, 1))
    mgr.wait_until_finished()
    if rank == 1:
        _kill_self_on("read", lambda name: name.startswith(f"{step_dir(1)}/"))
    _report_outcome(lambda: mgr.restore(into=_rank_state(rank, world, 0)), report)


def test_rank_killed_during_restore_fails_the_restore_on_the_others(
    tmp_path: pathlib.Path,
) -> None:
    root, report = tmp_path / "root", tmp_path / "rank0.json"
    codes = _run_with_a_dying_rank(_rank1_dies_during_restore, root, report)
    outcome = json.loads(report.read_text())
    assert codes[1] == -signal.SIGKILL
    assert outcome["type"] in ("CheckpointTimeoutError", "CheckpointError")
    assert outcome["elapsed"] < 10 + 10


def test_rank_killed_mid_save_fails_the_step_on_survivors(tmp_path: pathlib.Path) -> None:
    root, report = tmp_path / "root", tmp_path / "rank0.json"
    codes = _run_with_a_dying_rank(_rank1_dies_mid_save, root, report)
    outcome = json.loads(report.read_text())
    assert codes[1] == -signal.SIGKILL
    assert outcome["type"] == "SaveFailedError"
    assert "step 2" in outcome["error"]
    assert outcome["elapsed"] < 15 + 10
    assert outcome["steps"] == [1]
    # The previous step is whole and restorable here, at world size 1.
    with CheckpointManager(str(root), CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        result = mgr.restore()
    assert result is not None
    assert result.step == 1
    assert torch.equal(result.state["model"]["replicated"], torch.full((3,), 1.0))
