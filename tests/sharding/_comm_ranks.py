"""Rank functions of the all-gather tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sharding._comm import Communicator
from sharding._stats import ShardingStats

SIZES = (0, 1, 5, 4096, 300_001)
"""Shard sizes in elements: empty, tiny, odd and a few MB."""


def _shard(rank: int, n: int, salt: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1_000_000 * rank + 10_000_000 * salt


def gathers_in_flight(rank: int, world: int, members: list[int] | None) -> dict[str, Any]:
    """Several gathers issued before any is waited on, over the whole world or a subgroup
    (`members`, global ranks); the last one in place (the shard is its own output slot). A
    job's own send and receive (tag 0) is interleaved with them."""
    group = dist.new_group(members) if members is not None else None
    if members is not None and rank not in members:
        return {"skipped": True}
    comm = Communicator(group, torch.device("cpu"), ShardingStats(), None)
    size = comm.world_size
    me = comm.rank
    pending, outputs = [], []
    for salt, n in enumerate(SIZES):
        out = torch.full((n * size,), float("nan"))
        pending.append(comm.all_gather(out, _shard(me, n, salt)))
        outputs.append(out)
    in_place = torch.full((7 * size,), float("nan"))
    in_place[7 * me : 7 * (me + 1)] = _shard(me, 7, 99)
    pending.append(comm.all_gather(in_place, in_place[7 * me : 7 * (me + 1)]))
    outputs.append(in_place)
    peer_of = members if members is not None else list(range(world))
    job_msg = torch.full((3,), float(rank))
    partner = peer_of[(me + 1) % size]
    source = peer_of[(me - 1) % size]
    send = dist.isend(job_msg, partner)
    got = torch.empty(3)
    dist.recv(got, source)
    send.wait()
    for p in reversed(pending):
        p.wait()
    return {
        "outputs": outputs,
        "size": size,
        "job_msg": got,
        "source": source,
        "exchange": comm._gather_peers is not None,
    }
