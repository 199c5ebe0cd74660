"""Collectives over the data-parallel group, issued asynchronously, waited on with accounting.

[Note: streams and lifetimes] On CUDA every collective is issued from a dedicated
communication stream that first waits on the compute stream, so it overlaps the compute that
follows; `PendingCollective.wait()` makes the compute stream wait on it (a stream wait, the
host does not block). Every tensor a collective touches is either persistent or is freed only
after `wait()`, on the compute stream, so the caching allocator never hands its memory to
another user while the collective may still read or write it: no `record_stream` is needed.
Each `PendingCollective` holds its tensors until it has been waited on, so a temporary
input (e.g. the shard pushed after an optimizer step) cannot be freed early by accident.
On CPU (gloo) `async_op=True` runs the collective on gloo's threads and `wait()` blocks the
host; compute issued in between overlaps with it.

Without an initialised process group the engine runs at world size 1: collectives become the
equivalent local copies, so one code path serves every world size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from sharding._stats import CollectiveObserver, ShardingStats

__all__ = ["Communicator", "PendingCollective"]

# torch 2.13 renamed the flat collectives; older releases only have the *_tensor names.
_all_gather_flat: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
_reduce_scatter_flat: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)

# [Note: version counters] Autograd saved the parameters that alias a gathered buffer and
# re-checks their version in backward; re-filling the buffer (ZeRO-3 re-gathers it) must not
# count as a modification. c10d bumps the output's version when the work completes (on
# gloo's thread, at any time before `wait()` returns), so the version read at issue time is
# written back after the wait.
_keep_version: Callable[[torch.Tensor], Any] = torch.autograd._unsafe_preserve_version_counter  # type: ignore[attr-defined]


def _set_version(tensor: torch.Tensor, version: int) -> None:
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


class PendingCollective:
    """One issued collective; `wait()` exactly once before touching its output."""

    __slots__ = (
        "_comm",
        "_done",
        "_keep_version",
        "_tensors",
        "_version",
        "_work",
        "num_bytes",
        "op",
    )

    def __init__(
        self,
        comm: Communicator,
        op: str,
        work: Any,
        num_bytes: int,
        tensors: tuple[torch.Tensor, ...],
        keep_version: torch.Tensor | None = None,
    ) -> None:
        self._comm = comm
        # Referenced until `wait()`: see [Note: streams and lifetimes].
        self._tensors = tensors
        self._work = work
        self._keep_version = keep_version
        self._version = keep_version._version if keep_version is not None else 0
        self._done = False
        self.op = op
        self.num_bytes = num_bytes

    @property
    def done(self) -> bool:
        """Whether `wait()` has returned."""
        return self._done

    def is_completed(self) -> bool:
        """Whether the collective has finished (without waiting)."""
        return self._done or self._work is None or bool(self._work.is_completed())

    def wait(self) -> float:
        """Wait for completion (stream wait on CUDA) and account for it.

        Returns:
            Host seconds spent waiting.
        """
        if self._done:
            return 0.0
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            if self._keep_version is not None:
                _set_version(self._keep_version, self._version)
        seconds = time.perf_counter() - start
        self._done = True
        self._tensors = ()
        self._comm.record(self.op, self.num_bytes, seconds)
        return seconds


class Communicator:
    """Issues flat collectives on one process group and counts them."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        stats: ShardingStats,
        observer: CollectiveObserver | None,
    ) -> None:
        self.group = group
        self.device = device
        self._stats = stats
        self._observer = observer
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.distributed = True
        else:
            self.rank, self.world_size, self.distributed = 0, 1, False
        self._stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    def record(self, op: str, num_bytes: int, seconds: float) -> None:
        """Account for one completed collective."""
        self._stats.collective(op, num_bytes, seconds)
        if self._observer is not None:
            self._observer.on_collective(op, num_bytes, seconds)

    @contextlib.contextmanager
    def _on_comm_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> PendingCollective:
        """Gather every rank's `shard` into the flat `output` (rank-major)."""
        num_bytes = output.numel() * output.element_size()
        # The write must not bump the version of parameters that alias `output`: autograd
        # saved them in forward and re-checks the version in backward (ZeRO-3 re-gathers).
        with _keep_version(output), torch.no_grad():
            if not self.distributed:
                output.copy_(shard)
                return PendingCollective(self, "all_gather", None, num_bytes, ())
            pending = PendingCollective(
                self, "all_gather", None, num_bytes, (output, shard), keep_version=output
            )
            with self._on_comm_stream():
                pending._work = _all_gather_flat(output, shard, group=self.group, async_op=True)
        return pending

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> PendingCollective:
        """Sum `full` over ranks and keep this rank's contiguous slice in `output`."""
        num_bytes = full.numel() * full.element_size()
        with torch.no_grad():
            if not self.distributed:
                output.copy_(full)
                return PendingCollective(self, "reduce_scatter", None, num_bytes, ())
            with self._on_comm_stream():
                work = _reduce_scatter_flat(output, full, group=self.group, async_op=True)
        return PendingCollective(self, "reduce_scatter", work, num_bytes, (output, full))

    def all_reduce(self, tensor: torch.Tensor) -> PendingCollective:
        """Sum `tensor` over ranks in place."""
        num_bytes = tensor.numel() * tensor.element_size()
        if not self.distributed:
            return PendingCollective(self, "all_reduce", None, num_bytes, ())
        with self._on_comm_stream():
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return PendingCollective(self, "all_reduce", work, num_bytes, (tensor,))

    def broadcast_(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        """Overwrite `tensor` with group rank `src_rank`'s copy (blocking, not counted)."""
        if self.distributed:
            src = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
            dist.broadcast(tensor, src=src, group=self.group)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Blocking all-reduce of a small tensor (not counted: control traffic)."""
        if self.distributed:
            dist.all_reduce(value, group=self.group)
        return value
