"""Whether this node can hold the memory tier: one start-up line, and exit 2 or durable-only.

The tier keeps 2 slots per local rank (the newest complete snapshot is never overwritten) and,
with several nodes, one replica of the previous node's ranks (2 slots per rank as well). Its
bytes live in tmpfs (`memory_dir`), and tmpfs pages are charged to the memory cgroup of
whoever wrote them: on Kubernetes a `medium: Memory` emptyDir counts against the pod's
memory limit. A snapshot that does not fit would end in ENOSPC, or in the kernel's OOM killer;
so the daemon checks at start and says in one line (`memory_budget`) what it found and what it
needs:

    need = 2 slots x local ranks x state bytes per rank  +  replicas x 2 slots x the previous
           node's state (local ranks x state bytes per rank; `DaemonConfig.num_memory_replicas`:
           1 with --nnodes > 1 unless memory_replicas is 0)

[Note: the state size is an estimate] The ranks build the model after the daemon starts, so the
daemon builds the job once on the meta device (no memory) and counts: per parameter 12 bytes
(the engine's fp32 main weight plus AdamW's two fp32 moments, whatever the compute dtype), the
buffers at their own size, divided by the shard factor (the ranks one copy of the state spans:
the shard group under hybrid sharding, else the world, which `no_shard` also saves across,
[Note: replicated state is saved once] in `sharding/_state_dict.py`), at the smallest world an
elastic job may shrink to (the largest share per rank). Loader position, RNG and scheduler
state are bytes, left out. A job that cannot be built on the meta device (or outside its
process group) gives no estimate: the line says so and the tier starts unchecked.

An explicit `memory_every` > 0 that cannot fit is a configuration error (exit 2, naming the
numbers and the fixes); `auto` that cannot fit logs one warning and runs durable-only
(`memory_every` 0 in the config the ranks are handed). `start_memory_tier` is the daemon's one
call: reclaim (`memory_dir.py`), budget, claim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog

from daemon.agent.memory_dir import NodeMemoryDir
from daemon.config import DaemonConfig, StepInterval
from daemon.errors import MemoryTierBusyError, StartupCheckError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "NUM_SLOTS",
    "STATE_BYTES_PER_PARAM",
    "CgroupMemory",
    "MemoryBudget",
    "apply_memory_budget",
    "cgroup_memory",
    "estimate_state_bytes",
    "job_state_bytes",
    "start_memory_tier",
    "tmpfs_free_bytes",
]

_V1_MEMORY_CONTROLLER = "memory"
"""The cgroup v1 controller (and hierarchy) that accounts memory, tmpfs pages included."""

log = structlog.get_logger("trainingd.memory")

NUM_SLOTS = 2
"""Local slots per rank: one being written, the newest complete one kept."""
STATE_BYTES_PER_PARAM = 12
"""fp32 main weight (4) + AdamW's fp32 `exp_avg` and `exp_avg_sq` (8): the loop's optimizer."""
_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a huge number (9223372036854771712); above this: none."""


class CgroupMemory(NamedTuple):
    """The memory cgroup's limit and usage, where readable."""

    limit_bytes: int | None
    """`memory.max` (v2) or `memory.limit_in_bytes` (v1); None: no limit, or unreadable."""
    usage_bytes: int | None
    """`memory.current` (v2) or `memory.usage_in_bytes` (v1); None: unreadable."""

    @property
    def headroom_bytes(self) -> int | None:
        """What the cgroup can still take (None: unbounded or unknown)."""
        if self.limit_bytes is None:
            return None
        return max(self.limit_bytes - (self.usage_bytes or 0), 0)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def cgroup_memory(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> CgroupMemory:
    """This process's memory cgroup limit and usage (v2 first, then v1).

    Each hierarchy is read at the process's own cgroup path, then at the mount's root (a
    container with its own cgroup namespace sees its cgroup there).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_path, v1_path = None, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2_path = path.lstrip("/")
        elif _V1_MEMORY_CONTROLLER in controllers.split(","):
            v1_path = path.lstrip("/")
    candidates = []
    if v2_path is not None:
        for base in (root / v2_path, root):
            candidates.append((base / "memory.max", base / "memory.current"))
    if v1_path is not None:
        for base in (root / _V1_MEMORY_CONTROLLER / v1_path, root / _V1_MEMORY_CONTROLLER):
            candidates.append((base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"))
    for limit_path, usage_path in candidates:
        if limit_path.exists():
            return CgroupMemory(_read_int(limit_path), _read_int(usage_path))
    return CgroupMemory(None, None)


def tmpfs_free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still put in the filesystem holding `path` (or the
    nearest existing directory above it, where it would be created)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def estimate_state_bytes(model: nn.Module, shard_factor: int) -> int:
    """Bytes of one rank's training state: see [Note: the state size is an estimate]."""
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return math.ceil(params * STATE_BYTES_PER_PARAM / max(shard_factor, 1)) + buffers


@contextlib.contextmanager
def _init_skipped() -> Iterator[None]:
    """`torch.nn.init`'s in-place initializers return their tensor untouched, meanwhile.

    On the meta device they compute nothing anyway, but torch's meta `normal_` goes through a
    dynamo-disabled reference implementation that imports `torch._dynamo`: 2 s of the daemon's
    start for a count of parameters. (Transformers' `no_init_weights` does the same.) The
    daemon is single-threaded while it estimates.
    """
    import torch

    names = [n for n in vars(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {name: getattr(torch.nn.init, name) for name in names}

    def untouched(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    for name in names:
        setattr(torch.nn.init, name, untouched)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def job_state_bytes(cfg: DaemonConfig) -> int | None:
    """`estimate_state_bytes` of the configured job, built on the meta device; None when the
    job cannot be built there (see the Note)."""
    import torch

    from daemon.jobs.job import JobContext, load_job

    world = cfg.launch.min_nodes * cfg.launch.nproc_per_node
    factor = cfg.shard_group_size_at(world) or world
    try:
        build = load_job(cfg.train.job)
        with torch.device("meta"), _init_skipped():
            job = build(JobContext(rank=0, world_size=world, seed=cfg.train.seed))
        return estimate_state_bytes(job.model, factor)
    except Exception as err:  # any job code: the ranks will report it if it is real
        log.info("memory_budget_no_estimate", job=cfg.train.job, error=str(err))
        return None


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


@dataclasses.dataclass(kw_only=True, frozen=True)
class MemoryBudget:
    """What the memory tier needs on this node and what the node has."""

    memory_dir: Path
    """The tmpfs it lives in."""
    state_bytes_per_rank: int | None
    """Estimated state of one rank (None: no estimate)."""
    local_ranks: int
    """Ranks on this node."""
    num_replicas: int
    """Peer nodes' states held here (`DaemonConfig.num_memory_replicas`)."""
    free_bytes: int
    """What `memory_dir` can still take."""
    cgroup: CgroupMemory
    """The memory cgroup's limit and usage."""

    @property
    def need_bytes(self) -> int | None:
        """2 local slots per rank plus 2 slots per replicated peer rank (None: no estimate)."""
        if self.state_bytes_per_rank is None:
            return None
        node_state = self.local_ranks * self.state_bytes_per_rank
        # A replica is held in 2 slots too (`daemon/agent/replica/holdings.py`).
        return NUM_SLOTS * (1 + self.num_replicas) * node_state

    @property
    def fits(self) -> bool:
        """Whether the need fits the tmpfs and the cgroup (True without an estimate)."""
        need = self.need_bytes
        if need is None:
            return True
        headroom = self.cgroup.headroom_bytes
        return need <= self.free_bytes and (headroom is None or need <= headroom)

    def summary(self) -> str:
        """One line: the need and how it is made up, the room and the limit."""
        if self.state_bytes_per_rank is None or self.need_bytes is None:
            need = "need unknown (the job gives no estimate on the meta device)"
        else:
            per_rank, ranks = _size(self.state_bytes_per_rank), self.local_ranks
            need = f"need ~{_size(self.need_bytes)} ({NUM_SLOTS} slots x {ranks} ranks x {per_rank}"
            if self.num_replicas:
                need += (
                    f" + {self.num_replicas} replica x {NUM_SLOTS} slots x "
                    f"{_size(ranks * self.state_bytes_per_rank)}"
                )
            need += ", estimated)"
        room = f"{_size(self.free_bytes)} free in {self.memory_dir}"
        limit, usage = self.cgroup
        if limit is not None:
            used = "" if usage is None else f", {_size(usage)} in use"
            room += f"; memory cgroup limit {_size(limit)}{used}"
        return f"{need}; {room}"

    def fixes(self) -> str:
        """How to make it fit."""
        return (
            "give memory_dir more room (Kubernetes: a larger emptyDir sizeLimit and pod memory "
            "limit; Docker: --shm-size), or set memory_every 0 (durable checkpoints only)"
        )


def apply_memory_budget(
    cfg: DaemonConfig, *, state_bytes_per_rank: int | None, cgroup: CgroupMemory | None = None
) -> DaemonConfig:
    """Check the budget, log the `memory_budget` line; the config the ranks are handed.

    Args:
        cfg: the effective configuration, `memory_every` not 0.
        state_bytes_per_rank: `job_state_bytes(cfg)`.
        cgroup: the memory cgroup (default: this process's, `cgroup_memory()`).

    Returns:
        `cfg`, or with `auto` that cannot fit, `cfg` with `memory_every` 0 (durable-only).

    Raises:
        StartupCheckError: an explicit `memory_every` that cannot fit (exit 2).
    """
    ck = cfg.checkpoint
    budget = MemoryBudget(
        memory_dir=Path(ck.memory_dir),
        state_bytes_per_rank=state_bytes_per_rank,
        local_ranks=cfg.launch.nproc_per_node,
        num_replicas=cfg.num_memory_replicas,
        free_bytes=tmpfs_free_bytes(Path(ck.memory_dir)),
        cgroup=cgroup_memory() if cgroup is None else cgroup,
    )
    log.info(
        "memory_budget",
        summary=budget.summary(),
        memory_every=str(ck.memory_every),
        fits=budget.fits,
        need_bytes=budget.need_bytes,
        state_bytes_per_rank=state_bytes_per_rank,
        state_estimated=True,
        local_ranks=budget.local_ranks,
        slots=NUM_SLOTS,
        replicas=budget.num_replicas,
        free_bytes=budget.free_bytes,
        cgroup_limit_bytes=budget.cgroup.limit_bytes,
        cgroup_usage_bytes=budget.cgroup.usage_bytes,
    )
    if budget.fits:
        return cfg
    if not ck.memory_every.is_auto:
        raise StartupCheckError(
            f"memory_every={ck.memory_every}: the memory tier does not fit this node: "
            f"{budget.summary()}; {budget.fixes()}"
        )
    log.warning(
        "memory_tier_disabled",
        reason=f"memory_every=auto does not fit: {budget.summary()}",
        fix=budget.fixes(),
        memory_every=0,
    )
    off = dataclasses.replace(ck, memory_every=StepInterval(0))
    return dataclasses.replace(cfg, checkpoint=off)


def start_memory_tier(cfg: DaemonConfig) -> tuple[DaemonConfig, NodeMemoryDir]:
    """Reclaim this run's stale memory-tier directories, check the budget, claim ours.

    `auto` runs durable-only where the tier cannot be made (memory_dir unusable or too small);
    an explicit interval fails the start instead. With the tier off the directory is claimed
    for the semaphore ledger alone, where memory_dir allows ([Note: the semaphore ledger
    outlives the tier] in `memory_dir.py`).

    Returns:
        The config the ranks are handed (`memory_every` 0 when `auto` cannot run the tier)
        and this node's directory (`claimed` when the tier is on).

    Raises:
        MemoryTierBusyError: our directory is held by a daemon that may be alive (exit 2).
        StartupCheckError: an explicit `memory_every` cannot fit or cannot be created (exit 2).
    """
    memory = NodeMemoryDir(cfg.memory_tier_dir, cfg.run_id, cfg.launch.node_rank)
    every = cfg.checkpoint.memory_every
    try:
        if not every.is_off:
            memory.reclaim_stale()
            cfg = apply_memory_budget(cfg, state_bytes_per_rank=job_state_bytes(cfg))
            if not cfg.checkpoint.memory_every.is_off:
                memory.claim()
    except MemoryTierBusyError:
        raise
    except StartupCheckError as err:
        if not every.is_auto:
            raise
        log.warning("memory_tier_disabled", reason=str(err), memory_every=0)
        off = dataclasses.replace(cfg.checkpoint, memory_every=StepInterval(0))
        cfg = dataclasses.replace(cfg, checkpoint=off)
    # Off from the start, or `auto` gone durable-only.
    if cfg.checkpoint.memory_every.is_off:
        _keep_semaphore_ledger(memory)
    return cfg, memory


def _keep_semaphore_ledger(memory: NodeMemoryDir) -> None:
    """With the tier off, claim the directory for the semaphore ledger alone where memory_dir
    allows; else one line, and the daemon starts without it ([Note: the semaphore ledger
    outlives the tier] in `memory_dir.py`)."""
    try:
        memory.reclaim_stale()
        memory.claim(tier=False)
    except (MemoryTierBusyError, StartupCheckError) as err:
        log.info("semaphore_ledger_not_kept", reason=str(err))
