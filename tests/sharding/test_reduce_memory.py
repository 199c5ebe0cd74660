"""Memory of gradient reductions: no clone on gloo, room made before a unit's backward.

[Note: gloo reduce-scatter] in `sharding/_comm.py` and [Note: reduce memory] in
`sharding/_reduce.py`. In process: a one-rank gloo group (a real gloo reduce-scatter, which
clones its input) and fake buckets for the queue.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sharding._comm import Communicator, PendingCollective
from sharding._config import Strategy
from sharding._reduce import ReducePipeline
from sharding._stats import ShardingStats

_NUMEL = 8 << 20  # 32 MiB of fp32: far above any other allocation of the call


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks")] + [
        (name, ctypes.c_size_t)
        for name in ("hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not got back (heap plus mmapped chunks)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


@pytest.fixture
def gloo_one_rank() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_gloo_reduce_scatter_of_scratch_input_holds_no_clone(gloo_one_rank: None) -> None:
    comm = Communicator(None, torch.device("cpu"), ShardingStats(), None)
    full = torch.arange(_NUMEL, dtype=torch.float32)
    expected = full.clone()
    out = torch.empty(_NUMEL)
    before = _malloc_in_use()
    pending = comm.reduce_scatter(out, full, scratch_input=True)
    # gloo's own reduce-scatter clones the whole input at issue and holds it until released.
    held = _malloc_in_use() - before
    pending.wait()
    assert held < _NUMEL * 4 // 4
    assert torch.equal(out, expected)
    totals = comm.stats.snapshot().collectives["reduce_scatter"]
    assert (totals.count, totals.num_bytes) == (1, _NUMEL * 4)


def _bucket(strategy: Strategy, trains: bool = True) -> Any:
    return SimpleNamespace(trains=trains, strategy=strategy)


def test_room_for_a_units_reductions_is_made_before_its_backward() -> None:
    stats = ShardingStats()
    comm = Communicator(None, torch.device("cpu"), stats, None)
    pipe = ReducePipeline(comm, stats, max_inflight=3)
    for _ in range(3):
        pipe._push(PendingCollective(comm, "reduce_scatter", None, 4, ()), None, ())
    zero3 = Strategy.OPTIM_GRADS_PARAMS
    # Two buckets that will reduce (a frozen one will not): room for two under the bound 3.
    pipe.reserve_for([_bucket(zero3), _bucket(zero3), _bucket(zero3, False)], last_microbatch=True)
    assert len(pipe) == 1
    # Persistent-gradient strategies reduce from buffers that exist anyway: no early wait.
    pipe.reserve_for([_bucket(Strategy.NO_SHARD)], last_microbatch=True)
    assert len(pipe) == 1
    # More buckets than the bound: everything in flight is finished, nothing more.
    pipe.reserve_for([_bucket(zero3)] * 5, last_microbatch=True)
    assert len(pipe) == 0
