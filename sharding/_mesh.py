"""The 2-D data-parallel layout of hybrid sharding (HSDP): replicate x shard.

[Note: hybrid layout] With `ShardingConfig.shard_group_size = S` on a world of `W = R * S`
ranks, rank `g` sits in shard group `g // S` (ranks `[k*S, (k+1)*S)`, one node under the
daemon's default, since torchrun numbers a node's ranks consecutively) at shard position
`g % S`, and in replica group `g % S` (ranks `{g % S + k*S}`): the ranks holding the same
shard in every shard group. Buckets are laid out for `S` shards, so all-gathers,
reduce-scatters and the post-step weight gathers of ZeRO-1/2 stay inside a shard group
(inside a node); a gradient shard, once reduce-scattered, is all-reduced across its replica
group (one all-reduce of the shard per bucket and reduction), so every replica of a shard
holds the same sum and steps identically. Gradients are pre-divided by `W`, as without
replicas. Norms and overflow verdicts need the shard group only (replicas are identical);
broadcasts of initial weights and buffers span all `W` ranks. Checkpoints write each shard
once: replica 0 saves its pieces, the others save empty ones and receive replica 0's
values by a broadcast over their replica group on load ([Note: replicated state is saved
once] in `_state_dict.py`).

`dist.new_group` is collective over the whole world, in the same order on every rank, so
hybrid groups are built from the default group only, every group by every rank.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

__all__ = ["HybridGroups", "build_hybrid_groups"]


@dataclasses.dataclass(frozen=True)
class HybridGroups:
    """This rank's groups of the replicate x shard layout."""

    shard: dist.ProcessGroup
    """The ranks sharing one copy of the training state (this rank's shard group)."""
    replicate: dist.ProcessGroup
    """The ranks holding the same shard as this rank, one per shard group."""
    shard_gather: dist.ProcessGroup | None
    """A second group over the shard group's ranks for all-gathers (CUDA only: see
    [Note: streams and lifetimes] in `_comm.py`), else `None`."""
    shard_group_size: int
    """Ranks per shard group."""
    num_replicas: int
    """Number of shard groups (copies of the training state)."""


def build_hybrid_groups(shard_group_size: int, *, gather_group: bool) -> HybridGroups:
    """Split the default group into shard groups of consecutive ranks (collective).

    Args:
        shard_group_size: ranks per shard group; must divide the world size.
        gather_group: also build a second group per shard group for all-gathers.

    Raises:
        ValueError: `shard_group_size` does not divide the world size.
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % shard_group_size != 0:
        raise ValueError(
            f"ShardingConfig.shard_group_size={shard_group_size} does not divide the world "
            f"size {world}; use a divisor of it (e.g. the ranks per node) or None to shard "
            "over the whole world"
        )
    num_replicas = world // shard_group_size
    backend = dist.get_backend()
    shard = replicate = gather = None
    # Every rank creates every group, in one order: `new_group` is collective over the world.
    for k in range(num_replicas):
        ranks = list(range(k * shard_group_size, (k + 1) * shard_group_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            shard = group
    if gather_group:
        for k in range(num_replicas):
            ranks = list(range(k * shard_group_size, (k + 1) * shard_group_size))
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                gather = group
    for position in range(shard_group_size):
        ranks = list(range(position, world, shard_group_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            replicate = group
    assert shard is not None
    assert replicate is not None
    return HybridGroups(
        shard=shard,
        replicate=replicate,
        shard_gather=gather,
        shard_group_size=shard_group_size,
        num_replicas=num_replicas,
    )
