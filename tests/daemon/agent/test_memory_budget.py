"""The memory tier's start-up budget: the estimate, the cgroup, and what an unfit tier does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import structlog
from torch import nn

from daemon._config_load import load_config
from daemon.agent.memory_budget import (
    CgroupMemory,
    apply_memory_budget,
    cgroup_memory,
    estimate_state_bytes,
    job_state_bytes,
    start_memory_tier,
    tmpfs_free_bytes,
)
from daemon.agent.memory_dir import OWNER_FILE
from daemon.errors import MemoryTierBusyError, StartupCheckError

_GIB = 1 << 30


def test_the_estimate_counts_fp32_weights_and_adamw_moments_per_shard() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10))  # 130 parameters
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffers > 0
    assert estimate_state_bytes(model, 1) == 130 * 12 + buffers
    assert estimate_state_bytes(model, 4) == 130 * 3 + buffers  # parameters are sharded
    # The default job, built on the meta device: 834,304 parameters over 2 ranks.
    cfg = load_config({"nproc_per_node": "2"}, env={})
    assert job_state_bytes(cfg) == 834_304 * 12 // 2
    # Hybrid over 2 nodes x 2 ranks: one copy spans the node's 2 ranks, not the 4.
    two = {"nnodes": "2", "rdzv_endpoint": "n0:1", "strategy": "hybrid"}
    assert job_state_bytes(load_config(two, env={})) == 834_304 * 12 // 2
    # A job that cannot be built here gives no estimate, not an error.
    assert job_state_bytes(load_config({"job": "tests.daemon.agent.no_such:build"}, env={})) is None


def test_cgroup_limits_are_read_from_v2_then_v1_or_the_namespace_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    proc.write_text("0::/kubepods/pod1\n")
    (root / "kubepods" / "pod1").mkdir(parents=True)
    (root / "kubepods" / "pod1" / "memory.max").write_text("68719476736\n")
    (root / "kubepods" / "pod1" / "memory.current").write_text("1073741824\n")
    found = cgroup_memory(proc, root)
    assert found == CgroupMemory(64 * _GIB, _GIB)
    assert found.headroom_bytes == 63 * _GIB
    (root / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert cgroup_memory(proc, root) == CgroupMemory(None, _GIB)
    assert cgroup_memory(proc, root).headroom_bytes is None
    # v1 (memory controller line), seen at the mount's root in a cgroup namespace; its "no
    # limit" is a huge number.
    proc.write_text("4:memory:/docker/abc\n0::/\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(str(2 * _GIB))
    (root / "memory" / "memory.usage_in_bytes").write_text(str(_GIB // 2))
    assert cgroup_memory(proc, root) == CgroupMemory(2 * _GIB, _GIB // 2)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert cgroup_memory(proc, root).limit_bytes is None
    assert cgroup_memory(tmp_path / "absent", root) == CgroupMemory(None, None)


def test_what_fits_runs_an_explicit_misfit_exits_2_and_auto_goes_durable_only(
    tmp_path: Path,
) -> None:
    free = tmpfs_free_bytes(tmp_path / "shm" / "not-yet")  # measured where it would be made
    assert free > 0
    flags = {"memory_dir": str(tmp_path / "shm"), "nproc_per_node": "2"}
    unlimited = CgroupMemory(None, None)
    auto = load_config(flags, env={})
    with structlog.testing.capture_logs() as logs:
        assert apply_memory_budget(auto, state_bytes_per_rank=1000, cgroup=unlimited) is auto
    (line,) = logs
    assert line["event"] == "memory_budget"
    assert line["need_bytes"] == 2 * 2 * 1000
    assert line["fits"] is True
    assert line["state_estimated"] is True
    assert "need ~3.9 KiB (2 slots x 2 ranks x 1000 B, estimated)" in line["summary"]

    # Larger than the tmpfs: an explicit interval is a config error naming numbers and fixes.
    huge = free  # per rank: 2 slots x 2 ranks of it cannot fit
    explicit = load_config({**flags, "memory_every": "5"}, env={})
    with pytest.raises(StartupCheckError) as err:
        apply_memory_budget(explicit, state_bytes_per_rank=huge, cgroup=unlimited)
    message = str(err.value)
    assert message.startswith("memory_every=5: the memory tier does not fit this node: need ~")
    assert "2 slots x 2 ranks x" in message
    assert f"free in {tmp_path / 'shm'}" in message
    assert "sizeLimit" in message
    assert "--shm-size" in message
    assert "memory_every 0" in message
    assert "\n" not in message

    # auto: one warning, and the ranks are handed memory_every 0.
    with structlog.testing.capture_logs() as logs:
        off = apply_memory_budget(auto, state_bytes_per_rank=huge, cgroup=unlimited)
    assert str(off.checkpoint.memory_every) == "0"
    assert off == dataclasses.replace(auto, checkpoint=off.checkpoint)
    assert [e["event"] for e in logs] == ["memory_budget", "memory_tier_disabled"]
    assert logs[1]["log_level"] == "warning"

    # Room in the tmpfs but not in the memory cgroup (tmpfs pages are charged to it); with
    # several nodes a replica of the previous node counts too.
    two_nodes = load_config({**flags, "nnodes": "2", "rdzv_endpoint": "n0:1"}, env={})
    tight = CgroupMemory(limit_bytes=10_000, usage_bytes=5_000)
    with structlog.testing.capture_logs() as logs:
        assert apply_memory_budget(two_nodes, state_bytes_per_rank=1000, cgroup=tight) is not (
            two_nodes
        )
    assert logs[0]["need_bytes"] == (2 + 2 * 1) * 2 * 1000
    assert "2 slots x 2 ranks x 1000 B + 1 replica x 2 slots x 2.0 KiB" in logs[0]["summary"]
    assert "memory cgroup limit 9.8 KiB, 4.9 KiB in use" in logs[0]["summary"]
    # memory_replicas 0: no replica is held here, so none is counted.
    unreplicated = load_config(
        {**flags, "nnodes": "2", "rdzv_endpoint": "n0:1", "memory_replicas": "0"}, env={}
    )
    with structlog.testing.capture_logs() as logs:
        apply_memory_budget(unreplicated, state_bytes_per_rank=1000, cgroup=tight)
    assert logs[0]["need_bytes"] == 2 * 2 * 1000
    assert logs[0]["replicas"] == 0
    # No estimate: said so, and the tier starts unchecked.
    with structlog.testing.capture_logs() as logs:
        assert apply_memory_budget(explicit, state_bytes_per_rank=None, cgroup=tight) is explicit
    assert "need unknown" in logs[0]["summary"]


def test_start_memory_tier_off_auto_and_explicit(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    flags = {"memory_dir": str(shm), "run_id": "r", "nproc_per_node": "1"}
    # Off: the directory holds the semaphore ledger's owner record alone, no tier bytes
    # ([Note: the semaphore ledger outlives the tier]); released at exit.
    off = load_config({**flags, "memory_every": "0"}, env={})
    cfg, ledger = start_memory_tier(off)
    assert cfg is off
    assert (ledger.held, ledger.claimed) == (True, False)
    assert [p.name for p in (shm / "trainingd-r-0").iterdir()] == [OWNER_FILE]
    assert ledger.tier_bytes() == {"local": 0.0, "replica": 0.0}
    ledger.release()
    assert list(shm.iterdir()) == []
    # auto where it fits: the ranks' directory is claimed, and released at exit.
    auto = load_config(flags, env={})
    cfg, memory = start_memory_tier(auto)
    assert cfg is auto
    assert (shm / "trainingd-r-0" / "owner.json").exists()
    # Started again while this one holds it: refused, whatever the setting.
    with pytest.raises(MemoryTierBusyError, match="cannot run twice"):
        start_memory_tier(auto)
    memory.release()
    assert list(shm.iterdir()) == []
    # memory_dir unusable: auto trains durable-only, an explicit interval fails the start.
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    unusable = {**flags, "memory_dir": str(a_file / "shm")}
    with structlog.testing.capture_logs() as logs:
        cfg, memory = start_memory_tier(load_config(unusable, env={}))
    assert cfg.checkpoint.memory_every.is_off
    assert [e["event"] for e in logs] == ["memory_tier_disabled", "semaphore_ledger_not_kept"]
    assert not memory.held
    with pytest.raises(StartupCheckError, match="cannot list it"):
        start_memory_tier(load_config({**unusable, "memory_every": "3"}, env={}))
    # With the tier off an unusable memory_dir costs the ledger alone: the start goes on.
    with structlog.testing.capture_logs() as logs:
        cfg, memory = start_memory_tier(load_config({**unusable, "memory_every": "0"}, env={}))
    assert [e["event"] for e in logs] == ["semaphore_ledger_not_kept"]
    assert "cannot list it" in logs[0]["reason"]
    assert not memory.held
    assert a_file.read_text() == ""
