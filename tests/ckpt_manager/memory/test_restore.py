"""The memory tier on real gloo ranks: restore from memory, a rank killed mid-snapshot, a
flipped byte, another world size.

One story over a few short spawns (each spawn is a restart of every rank): the slot files in
one directory outlive the ranks, as they outlive a SIGKILLed rank under the daemon.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
from typing import Any

import pytest
import torch

from ckpt_manager import CheckpointConfig, CheckpointManager, MemoryTierConfig, RankLocal
from ckpt_manager._save import staging
from tests.ckpt_manager.conftest import Shard
from tests.support.dist import RankFailedError, run_on_ranks
from tests.support.request_count import count_requests

pytestmark = pytest.mark.slow

RUN_ID = "memory-run"
FLAT = 35  # elements of the flat-sharded tensor
_READS = ("read", "read_many", "read_with_version", "list_names", "size", "exists")


def _state(rank: int, world: int, version: int) -> dict[str, Any]:
    """This rank's state after `version` steps: sharded pieces, a replicated tensor (rank 0
    writes it), an HSDP-style empty replica piece and a DTensor replica (the durable file
    leaves both out on rank 1), plain values and RankLocal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    per = -(-FLAT // world)
    a, b = min(FLAT, rank * per), min(FLAT, (rank + 1) * per)
    whole = torch.arange(FLAT, dtype=torch.float32) * (version + 1) + 0.5
    hsdp = torch.arange(4, dtype=torch.float64) - version
    mesh = init_device_mesh("cpu", (world,))
    return {
        "model": {
            "flat": Shard(whole[a:b].clone(), (FLAT,), (0,), (a, b)),
            "replicated": torch.full((3,), float(version), dtype=torch.bfloat16),
            # The sharding engine's HSDP replica: an empty flat piece on rank 1.
            "hsdp": Shard(
                hsdp.clone() if rank == 0 else hsdp[:0].clone(),
                (4,),
                (0,),
                (0, 4) if rank == 0 else (0, 0),
            ),
            "dt": distribute_tensor(torch.arange(6.0) * version, mesh, [Replicate()]),
        },
        "sched": {"last_epoch": version, "lr": 0.1 * version},
        "rng": RankLocal({"seed": torch.tensor([rank * 100 + version]), "pos": rank + version}),
    }


def _template(rank: int, world: int) -> dict[str, Any]:
    state = _state(rank, world, 0)
    for tensor in (state["model"]["flat"].local, state["model"]["replicated"]):
        tensor.fill_(-1)
    state["model"]["dt"].to_local().fill_(-1)
    state["sched"] = {"last_epoch": -1, "lr": -1.0}
    state["rng"] = RankLocal({"seed": torch.tensor([-1]), "pos": -1})
    return state


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """What a rank compares bitwise: every tensor as this rank holds it, and the values."""
    model = state["model"]
    rng = state["rng"].value if isinstance(state["rng"], RankLocal) else state["rng"]
    return {
        "flat": model["flat"].local.clone(),
        "replicated": model["replicated"].clone(),
        "hsdp": model["hsdp"].local.clone(),
        "dt": model["dt"].to_local().clone(),
        "sched": dict(state["sched"]),
        "rng": {"seed": rng["seed"].clone(), "pos": rng["pos"]},
    }


def _config(memory: str) -> CheckpointConfig:
    return CheckpointConfig(memory=MemoryTierConfig(memory), finalize_timeout_s=60)


def _save_then_snapshots(rank: int, world: int, root: str, memory: str) -> list[int]:
    """A durable step 1 (written from its memory slot), then memory-only steps 2 and 3."""
    with CheckpointManager(root, _config(memory), run_id=RUN_ID) as mgr:
        assert mgr.restore() is None  # first start: nothing anywhere
        mgr.save(1, _state(rank, world, 1), metrics={"loss": 1.0})
        mgr.before_optimizer_step()
        mgr.wait_until_finished()
        for step in (2, 3):
            mgr.save(step, _state(rank, world, step), durable=False)
            mgr.before_optimizer_step()
            mgr.maybe_finalize()
        stats = mgr.stats()
        assert stats.inflight == 0
        assert stats.memory_bytes_held > 0
        return mgr.all_steps()


def _restore_from_memory(rank: int, world: int, root: str, memory: str) -> dict[str, Any]:
    """Fresh ranks: restore counts storage reads and looks at the lease, then the run goes on
    (a durable step 4)."""
    with CheckpointManager(root, _config(memory), run_id=RUN_ID) as mgr:
        template = _template(rank, world)
        with count_requests(mgr.storage) as counted:
            result = mgr.restore(into=template)
        assert result is not None
        reads = sum(counted.calls[name] for name in _READS)
        # [Note: the root opens after a memory restore]: the lease is still the previous
        # life's until the run saves again.
        lease_before_save = _lease_pid(root)
        restored = _plain(result.state)
        assert result.state["model"]["dt"] is template["model"]["dt"]  # filled in place
        mgr.save(4, _state(rank, world, 4))  # numbering goes on past the memory step
        mgr.wait_until_finished()
        return {
            "lease_taken_by_restore": lease_before_save == os.getpid(),
            "lease_taken_by_save": _lease_pid(root) == os.getpid(),
            "step": result.step,
            "source": result.source,
            "reason": result.fallback_reason,
            "reads": reads,
            "read_bytes": counted.read_bytes,
            "state": restored,
            "expected": _plain(_state(rank, world, 3)),
            "steps": mgr.all_steps(),
        }


def _lease_pid(root: str) -> int | None:
    """The pid the root's lease names (None: no lease document)."""
    try:
        return int(json.loads(pathlib.Path(root, "_LEASE.json").read_text())["pid"])
    except FileNotFoundError:
        return None


def _restore(rank: int, world: int, root: str, memory: str, expected: int) -> dict[str, Any]:
    with CheckpointManager(root, _config(memory), run_id=RUN_ID) as mgr:
        result = mgr.restore(into=_template(rank, world))
        assert result is not None
        return {
            "step": result.step,
            "source": result.source,
            "reason": result.fallback_reason,
            "state": _plain(result.state),
            "expected": _plain(_state(rank, world, expected)),
        }


def _one_rank_restore(rank: int, world: int, root: str, memory: str) -> dict[str, Any]:
    with CheckpointManager(root, _config(memory), run_id=RUN_ID) as mgr:
        result = mgr.restore()
        assert result is not None
        return {"step": result.step, "source": result.source, "reason": result.fallback_reason}


def _killed_mid_snapshot(rank: int, world: int, root: str, memory: str) -> None:
    """Snapshots 5 and 6 on both ranks, then 7: rank 0 completes it, rank 1 SIGKILLs itself
    after the first tensors of its payload were copied (the slot it fills held step 5)."""
    import torch.distributed as dist

    with CheckpointManager(root, _config(memory), run_id=RUN_ID) as mgr:
        assert mgr.restore(into=_template(rank, world)) is not None
        for step in (5, 6):
            mgr.save(step, _state(rank, world, step), durable=False)
            mgr.before_optimizer_step()
        seven = _state(rank, world, 7)  # collective (the DTensor's broadcast): on both ranks
        if rank == 0:
            mgr.save(7, seven, durable=False)
            mgr.before_optimizer_step()
            mgr.maybe_finalize()
            assert mgr.stats().newest_memory_step == 7
        dist.barrier()
        if rank == 1:
            # The staging copy checksums the header, then each batch of tensors behind its
            # copy ([Note: small tensors in one call]): the second checksum follows a copy.
            crc = staging.checksum
            calls = []

            def dies_midway(*args: Any) -> int:
                if calls:
                    os.kill(os.getpid(), signal.SIGKILL)
                calls.append(True)
                return crc(*args)

            staging.checksum = dies_midway  # type: ignore[assignment]
            mgr.save(7, seven, durable=False)
            mgr.before_optimizer_step()
            raise AssertionError("rank 1 survived its own SIGKILL")


def _flip_a_byte_in_every_snapshot(memory: pathlib.Path, rank: int, step: int | None = None) -> int:
    """Flip the last byte of each snapshot's payload (a tensor's), or only of those of
    `step`; returns how many (flipping again puts the bytes back)."""
    flipped = 0
    for meta in memory.glob(f"rank-{rank:05d}.slot-*.json"):
        if step is not None and json.loads(meta.read_text()).get("step") != step:
            continue
        payload = meta.with_suffix("")
        at = json.loads(meta.read_text())["payload_bytes"] - 1
        with payload.open("r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x01]))
        flipped += 1
    return flipped


def _equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("flat", "replicated", "hsdp", "dt"):
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key
    assert got["sched"] == want["sched"]
    assert torch.equal(got["rng"]["seed"], want["rng"]["seed"])
    assert got["rng"]["pos"] == want["rng"]["pos"]


def test_memory_first_then_durable_fallbacks(tmp_path: pathlib.Path) -> None:
    root, memory = str(tmp_path / "ckpt"), tmp_path / "shm"
    memory.mkdir()
    assert run_on_ranks(_save_then_snapshots, 2, root, str(memory), timeout_s=120) == [[1]] * 2

    # Fresh ranks restore step 3 from memory, bitwise, reading nothing from storage.
    out = run_on_ranks(_restore_from_memory, 2, root, str(memory), timeout_s=120)
    for rank in (0, 1):
        got = out[rank]
        assert (got["step"], got["source"], got["reason"]) == (3, "memory", None)
        assert (got["reads"], got["read_bytes"]) == (0, 0)
        _equal(got["state"], got["expected"])
        assert got["steps"] == [1, 4]
    # Nor did the start: the coordinator took the lease only when the run saved again.
    assert (out[0]["lease_taken_by_restore"], out[0]["lease_taken_by_save"]) == (False, True)

    # Another world size: the durable tier, with the reason.
    (got,) = run_on_ranks(_one_rank_restore, 1, root, str(memory), timeout_s=120)
    assert (got["step"], got["source"]) == (4, "durable")
    assert got["reason"].startswith("rank 0 holds no verified memory step")
    assert "world size 2 at snapshot, 1 now" in got["reason"]

    # A rank SIGKILLed in the middle of a snapshot copy: its older slot stays valid and the
    # agreement picks the older step, held by both.
    with pytest.raises(RankFailedError, match="exited without a result"):
        run_on_ranks(_killed_mid_snapshot, 2, root, str(memory), timeout_s=120)
    out = run_on_ranks(_restore, 2, root, str(memory), 6, timeout_s=120)
    for rank in (0, 1):
        assert (out[rank]["step"], out[rank]["source"]) == (6, "memory")
        _equal(out[rank]["state"], out[rank]["expected"])

    # A flipped byte in rank 1's slots: never those bytes, the newest durable step instead.
    assert _flip_a_byte_in_every_snapshot(memory, 1) == 1  # step 6's (7's was cut short)
    _durable_step_4_because(root, memory, "rank 1 holds no verified memory step")

    # Killed mid-snapshot again (after the durable restore of step 4 above).
    # [Note: the chosen slot is verified once] Rank 0's newest slot (7) verifies, its older
    # one (6) is offered unverified; rank 1 holds only 6, so 6 is agreed, and a flipped byte
    # in rank 0's copy of it is found at the load: the durable step, never those bytes.
    with pytest.raises(RankFailedError, match="exited without a result"):
        run_on_ranks(_killed_mid_snapshot, 2, root, str(memory), timeout_s=120)
    assert _flip_a_byte_in_every_snapshot(memory, 0, step=6) == 1
    _durable_step_4_because(root, memory, "memory step 6 did not load: rank 0:")


def _durable_step_4_because(root: str, memory: pathlib.Path, reason: str) -> None:
    """A restore on 2 ranks gives durable step 4 bitwise, for a checksum mismatch named in a
    reason that starts with `reason`."""
    out = run_on_ranks(_restore, 2, root, str(memory), 4, timeout_s=120)
    for rank in (0, 1):
        got = out[rank]
        assert (got["step"], got["source"]) == (4, "durable")
        assert got["reason"].startswith(reason)
        assert "checksum mismatch" in got["reason"]
        _equal(got["state"], got["expected"])
