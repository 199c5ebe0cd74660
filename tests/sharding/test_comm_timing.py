"""Collective timings: host time on CPU, deferred CUDA-event stream waits (faked on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sharding._comm import Communicator, _StreamWait
from sharding._stats import ShardingStats


@dataclasses.dataclass
class _FakeEvent:
    """Stands in for `torch.cuda.Event`: done or not, and a time in ms."""

    at_ms: float
    done: bool = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at_ms - self.at_ms


def _wait(op: str, started_ms: float, ended_ms: float, done: bool) -> _StreamWait:
    return _StreamWait(op, 4096, _FakeEvent(started_ms), _FakeEvent(ended_ms, done))  # type: ignore[arg-type]


def test_cpu_records_host_time_at_once() -> None:
    stats = ShardingStats()
    comm = Communicator(None, torch.device("cpu"), stats, None)
    assert comm.device_wait_started() is None
    out, shard = torch.empty(4), torch.ones(4)
    comm.all_gather(out, shard).wait()
    totals = stats.snapshot().collectives["all_gather"]
    assert (totals.count, totals.num_bytes) == (1, 16)


def test_stream_waits_are_reported_in_order_once_the_gpu_passed_them() -> None:
    stats = ShardingStats()
    comm = Communicator(None, torch.device("cpu"), stats, None)
    comm._stream_waits.extend(
        [
            _wait("reduce_scatter", 0.0, 2.5, done=True),
            _wait("all_gather", 3.0, 3.5, done=False),  # the GPU has not got there yet
            _wait("all_gather", 4.0, 5.0, done=True),
        ]
    )
    comm.flush_timings()
    snap = stats.snapshot().collectives
    # Only the first: the second is still ahead on the stream, so the third waits behind it.
    assert snap["reduce_scatter"].seconds == pytest.approx(0.0025)
    assert "all_gather" not in snap or snap["all_gather"].count == 0
    comm.flush_timings(block=True)
    snap = stats.snapshot().collectives
    assert snap["all_gather"].count == 2
    assert snap["all_gather"].seconds == pytest.approx(0.0015)
    assert not comm._stream_waits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_collectives_are_timed_by_events_on_a_one_rank_nccl_group() -> None:
    import datetime
    import os

    import torch.distributed as dist

    from tests.support.dist import free_port

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        stats = ShardingStats()
        comm = Communicator(None, device, stats, None)
        assert comm.gather_group is not None  # all-gathers on their own NCCL group
        out, shard = torch.empty(1 << 20, device=device), torch.ones(1 << 20, device=device)
        comm.all_gather(out, shard).wait()
        comm.reduce_scatter(shard, out).wait()
        comm.flush_timings(block=True)
        snap = stats.snapshot().collectives
        assert snap["all_gather"].count == snap["reduce_scatter"].count == 1
        assert snap["all_gather"].seconds >= 0.0
        assert torch.equal(out, torch.ones_like(out))
    finally:
        dist.destroy_process_group()
