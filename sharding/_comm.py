"""Collectives over the data-parallel group, issued asynchronously, waited on with accounting.

Under hybrid sharding ([Note: hybrid layout] in `_mesh.py`) the flat collectives run on the
shard group and a reduced gradient shard is all-reduced over the replica group.

[Note: streams and lifetimes] On CUDA a collective is issued from the current (compute)
stream with `async_op=True`: NCCL runs it on its process group's own stream, which first waits
for the compute issued so far, so it overlaps the compute that follows; `PendingCollective.wait()`
makes the compute stream wait on it (a stream wait, the host does not block). No extra
communication stream sits in between: one stream shared by all-gathers and reduce-scatters
would only add a second queue in which a backward prefetch waits behind pending reductions.
A process group runs its collectives in issue order on its one NCCL stream, so all-gathers go
to a second NCCL group over the same ranks (`gather_group`, made when the engine's group spans
the whole world, the only case where every rank can take part in creating it): a backward
prefetch then starts while earlier reduce-scatters are still running, independent of them.
Lifetimes: every tensor a collective touches is held by its `PendingCollective` until `wait()`
(and ProcessGroupNCCL records it on its stream); after `wait()` the compute stream is ordered
after the collective, so a tensor freed on the compute stream from then on cannot be handed to
another user while NCCL still reads or writes it. A temporary input (e.g. the shard pushed
after an optimizer step) therefore cannot be freed early by accident.
On CPU (gloo) `async_op=True` runs the collective on gloo's threads and `wait()` blocks the
host; compute issued in between overlaps with it.

[Note: collective timings] `trainingd_fsdp_collective_seconds` is the time the engine waited
for a collective. On CPU that is the host's time in `wait()`. On CUDA the host does not wait,
the compute stream does: a pair of timing events recorded on the compute stream around the
stream wait measures exactly that stall, read with `elapsed_time` once the GPU has passed the
second event (polled without blocking at every issue and wait, so a timing is reported at
the latest with the next collective; `flush_timings(block=True)` settles all of them).

[Note: gloo reduce-scatter] Gloo has no reduce-scatter of its own: `reduce_scatter_tensor`
clones the whole input, all-reduces the clone and copies this rank's slice out when waited
on, and the work holds the clone until it is released. With up to `max_inflight_reductions`
reductions in flight that is one more full-size gradient bucket per reduction (a whole
unit's gradients, 48 MiB per block of a d_model-1024 GPT). The engine's reduce input is a
scratch bucket it never reads again (`scratch_input=True`), so on gloo the engine runs the
same all-reduce in place on it and copies its slice out in `wait()`: the same arithmetic
and the same bytes on the wire, without the clone. NCCL has a real reduce-scatter and keeps
it.

[Note: gloo all-gather] Gloo's flat all-gather (`all_gather_single`) moved large gathers about
3x slower than the same bytes sent point to point on the 2-core VM, and staged a full copy of
each gather in flight (`bench/gloo_gather.py`, two ranks: 64 MiB 66 vs 23 ms, 128 MiB 132 vs
46 ms; 4-16 MiB 0.7x; below 1 MiB within the noise). Every ZeRO-3 step gathers the
weights, and a restore completes the replicated ranges of `no_shard` with all-gathers (256 MiB
of state per rank: about 0.4 s of the restart, [Note: replicated state is saved once] in
`_state_dict.py`). So on gloo the engine gathers by exchange (`_exchange_gather`): a rank
copies its shard into its own slot of the output (unless it is that slot), posts one send of
its shard to every other rank of the gather group and one receive into each other rank's slot,
and `wait()` waits for all of them. The bytes on the wire are a ring's ((n - 1) shards out and
in per rank); only the transport differs. Matching is safe because gloo pairs match a
point-to-point message with the receives posted for its tag in order, and every rank issues its
gathers in the same order (as any collective requires); `_GATHER_TAG` keeps them apart from a
job's own sends. NCCL keeps its all-gather.

Without an initialised process group the engine runs at world size 1: collectives become the
equivalent local copies, so one code path serves every world size.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from sharding._mesh import HybridGroups
from sharding._stats import CollectiveObserver, ShardingStats
from sharding.errors import ShardingError

__all__ = ["Communicator", "PendingCollective"]

# torch 2.13 renamed the flat collectives; older releases only have the *_tensor names.
_all_gather_flat: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
_reduce_scatter_flat: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)

_GATHER_TAG = 0x46_47_41
"""Tag of the point-to-point messages of a gloo all-gather ([Note: gloo all-gather])."""

# [Note: version counters] Autograd saved the parameters that alias a gathered buffer and
# re-checks their version in backward; re-filling the buffer (ZeRO-3 re-gathers it) must not
# count as a modification. c10d bumps the output's version when the work completes (on
# gloo's thread, at any time before `wait()` returns), so the version read at issue time is
# written back after the wait.
_keep_version: Callable[[torch.Tensor], Any] = torch.autograd._unsafe_preserve_version_counter  # type: ignore[attr-defined]


def _set_version(tensor: torch.Tensor, version: int) -> None:
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


def _copy_slice(output: torch.Tensor, full: torch.Tensor, start: int) -> None:
    with torch.no_grad():
        output.copy_(full[start : start + output.numel()])


class _StreamWait(NamedTuple):
    """A CUDA stream wait on a collective, timed by two events (see [Note: collective timings])."""

    op: str
    num_bytes: int
    started: torch.cuda.Event
    ended: torch.cuda.Event


class _Exchange:
    """The sends and receives of one all-gather by exchange, waited on as one work."""

    __slots__ = ("_works",)

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class PendingCollective:
    """One issued collective; `wait()` exactly once before touching its output."""

    __slots__ = (
        "_comm",
        "_done",
        "_keep_version",
        "_tensors",
        "_then",
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
        then: Callable[[], None] | None = None,
    ) -> None:
        self._comm = comm
        # Referenced until `wait()`: see [Note: streams and lifetimes].
        self._tensors = tensors
        self._work = work
        # Runs right after the work is done, before anyone reads the output.
        self._then = then
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
        started = None
        if self._work is not None:
            started = self._comm.device_wait_started()
            self._work.wait()
            if self._keep_version is not None:
                _set_version(self._keep_version, self._version)
            if self._then is not None:
                self._then()
        seconds = time.perf_counter() - start
        self._done = True
        # Drop the work too: a gloo work keeps its own temporaries (e.g. the full-size copy
        # of a reduce-scatter's input) for as long as it is referenced.
        self._tensors, self._work, self._then = (), None, None
        if started is None:
            self._comm.record(self.op, self.num_bytes, seconds)
        else:
            self._comm.device_wait_ended(self.op, self.num_bytes, started)
        return seconds


class Communicator:
    """Issues flat collectives on one process group and counts them."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        stats: ShardingStats,
        observer: CollectiveObserver | None,
        *,
        hybrid: HybridGroups | None = None,
    ) -> None:
        """Communicate over `group`, or over `hybrid`'s shard and replica groups.

        Args:
            group: the data-parallel group (`None`: the default group).
            device: where the collectives' tensors live.
            stats: counters to update.
            observer: receives one call per completed collective.
            hybrid: the replicate x shard groups ([Note: hybrid layout] in `_mesh.py`);
                `group` must then be the default group.
        """
        self.dp_group = group
        """The whole data-parallel group (broadcasts of initial weights and buffers)."""
        self.group = hybrid.shard if hybrid is not None else group
        """The shard group: all-gathers, reduce-scatters, norms (the data-parallel group
        unless hybrid)."""
        self.replica_group = hybrid.replicate if hybrid is not None else None
        """The group holding the same shard in every shard group (`None` unless hybrid)."""
        self.device = device
        self._stats = stats
        self._observer = observer
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.dp_rank = dist.get_rank(group)
            self.dp_world_size = dist.get_world_size(group)
            self.distributed = True
        else:
            self.rank, self.world_size, self.distributed = 0, 1, False
            self.dp_rank, self.dp_world_size = 0, 1
        self.replica_rank = 0
        """Index of this rank's shard group (0 unless hybrid); replica 0 saves checkpoints."""
        self.num_replicas = 1
        """Number of shard groups holding a copy of the training state."""
        if hybrid is not None:
            self.replica_rank = dist.get_rank(hybrid.replicate)
            self.num_replicas = hybrid.num_replicas
        self._on_cuda = device.type == "cuda"
        self._stream_waits: collections.deque[_StreamWait] = collections.deque()
        self.gather_group = self.group
        """The group all-gathers run on: a second NCCL group on CUDA (see
        [Note: streams and lifetimes]), else `group`."""
        if hybrid is not None:
            self.gather_group = hybrid.shard_gather or hybrid.shard
        elif self._on_cuda and self.distributed and self._spans_world(group):
            self.gather_group = dist.new_group(backend=dist.get_backend(group))
        self._in_place_reduce_scatter = (
            self.distributed and not self._on_cuda and "gloo" in str(dist.get_backend(self.group))
        )
        """Whether a reduce-scatter of a scratch input runs as an in-place all-reduce
        ([Note: gloo reduce-scatter])."""
        self._gather_peers: list[int] | None = None
        """On gloo: the global rank of each rank of the gather group, in the group's order
        ([Note: gloo all-gather]); None where the backend's all-gather is used."""
        self._gather_rank = 0
        """This rank's place in the gather group."""
        gather_on_gloo = self.distributed and not self._on_cuda
        if gather_on_gloo and "gloo" in str(dist.get_backend(self.gather_group)):
            gather_world = dist.get_world_size(self.gather_group)
            self._gather_rank = dist.get_rank(self.gather_group)
            self._gather_peers = [
                r if self.gather_group is None else dist.get_global_rank(self.gather_group, r)
                for r in range(gather_world)
            ]

    @property
    def gathers_in_place(self) -> bool:
        """Whether `all_gather` takes this rank's slot of `output` as its shard (a gather in
        place: gloo's exchange, [Note: gloo all-gather]; NCCL gets a separate input)."""
        return self._gather_peers is not None

    @property
    def stats(self) -> ShardingStats:
        """The engine's counters (buckets count their deferred weight gathers there)."""
        return self._stats

    @staticmethod
    def _spans_world(group: dist.ProcessGroup | None) -> bool:
        # `new_group` is collective over the whole world: only a group every rank belongs to
        # is sure to be built on every rank, in the same order.
        return group is None or dist.get_world_size(group) == dist.get_world_size()

    def record(self, op: str, num_bytes: int, seconds: float) -> None:
        """Account for one completed collective."""
        self._stats.collective(op, num_bytes, seconds)
        if self._observer is not None:
            self._observer.on_collective(op, num_bytes, seconds)

    def device_wait_started(self) -> torch.cuda.Event | None:
        """On CUDA: a timing event on the compute stream, before it waits (None on CPU)."""
        if not self._on_cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def device_wait_ended(self, op: str, num_bytes: int, started: torch.cuda.Event) -> None:
        """On CUDA: close the timing opened by `device_wait_started`; reported once measured."""
        ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ended.record(torch.cuda.current_stream(self.device))
        self._stream_waits.append(_StreamWait(op, num_bytes, started, ended))
        self.flush_timings()

    def flush_timings(self, *, block: bool = False) -> None:
        """Report the CUDA stream waits the GPU has passed (all of them with `block`).

        See [Note: collective timings]; a no-op on CPU, where `wait()` reports at once.
        """
        # Events recorded on one stream complete in order: stop at the first one still ahead.
        while self._stream_waits and (block or self._stream_waits[0].ended.query()):  # type: ignore[no-untyped-call]
            wait = self._stream_waits.popleft()
            wait.ended.synchronize()
            seconds = wait.started.elapsed_time(wait.ended) / 1000.0
            self.record(wait.op, wait.num_bytes, seconds)

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
            self.flush_timings()
            if self._gather_peers is not None:
                pending._work = self._exchange_gather(output, shard)
            else:
                pending._work = _all_gather_flat(
                    output, shard, group=self.gather_group, async_op=True
                )
        return pending

    def _exchange_gather(self, output: torch.Tensor, shard: torch.Tensor) -> _Exchange:
        """All-gather `shard` into `output` by point-to-point messages ([Note: gloo all-gather])."""
        assert self._gather_peers is not None
        peers, me = self._gather_peers, self._gather_rank
        n = shard.numel()
        if output.numel() != n * len(peers):
            raise ShardingError(
                f"all-gather output of {output.numel()} elements for {len(peers)} shards of {n}"
            )
        if n == 0:
            return _Exchange([])
        flat = output.view(-1)
        slots = [flat[i * n : (i + 1) * n] for i in range(len(peers))]
        own = slots[me]
        if own.data_ptr() != shard.data_ptr():  # else the caller gathers in place
            own.copy_(shard.reshape(-1))
        # Sent from `own`: contiguous, and no receive writes it.
        works = []
        for index, peer in enumerate(peers):
            if index != me:
                works.append(dist.isend(own, peer, group=self.gather_group, tag=_GATHER_TAG))
        for index, peer in enumerate(peers):
            if index != me:
                works.append(
                    dist.irecv(slots[index], peer, group=self.gather_group, tag=_GATHER_TAG)
                )
        return _Exchange(works)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, *, scratch_input: bool = False
    ) -> PendingCollective:
        """Sum `full` over ranks and keep this rank's contiguous slice in `output`.

        Args:
            output: receives this rank's slice of the sum (`full.numel() // world_size`).
            full: this rank's whole contribution.
            scratch_input: the caller never reads `full` again, so it may be overwritten:
                on gloo the sum is then computed in place ([Note: gloo reduce-scatter]).
        """
        num_bytes = full.numel() * full.element_size()
        with torch.no_grad():
            if not self.distributed:
                output.copy_(full)
                return PendingCollective(self, "reduce_scatter", None, num_bytes, ())
            self.flush_timings()
            if scratch_input and self._in_place_reduce_scatter:
                # [Note: gloo reduce-scatter]
                work = dist.all_reduce(full, group=self.group, async_op=True)
                lo = self.rank * output.numel()
                then = functools.partial(_copy_slice, output, full, lo)
                return PendingCollective(
                    self, "reduce_scatter", work, num_bytes, (output, full), then=then
                )
            work = _reduce_scatter_flat(output, full, group=self.group, async_op=True)
        return PendingCollective(self, "reduce_scatter", work, num_bytes, (output, full))

    def all_reduce(self, tensor: torch.Tensor) -> PendingCollective:
        """Sum `tensor` over ranks in place."""
        num_bytes = tensor.numel() * tensor.element_size()
        if not self.distributed:
            return PendingCollective(self, "all_reduce", None, num_bytes, ())
        self.flush_timings()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return PendingCollective(self, "all_reduce", work, num_bytes, (tensor,))

    def all_reduce_replicas(self, tensor: torch.Tensor) -> PendingCollective:
        """Sum a reduced shard in place over the replica group (hybrid; counted as all_reduce).

        Without replicas nothing is sent and the returned collective is already done.
        """
        num_bytes = tensor.numel() * tensor.element_size()
        if self.replica_group is None or self.num_replicas == 1:
            return PendingCollective(self, "all_reduce", None, num_bytes, ())
        self.flush_timings()
        work = dist.all_reduce(tensor, group=self.replica_group, async_op=True)
        return PendingCollective(self, "all_reduce", work, num_bytes, (tensor,))

    def broadcast_replicas_(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` with replica 0's copy (hybrid; blocking, not counted)."""
        if self.replica_group is not None and self.num_replicas > 1:
            src = dist.get_global_rank(self.replica_group, 0)
            dist.broadcast(tensor, src=src, group=self.replica_group)

    def broadcast_(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        """Overwrite `tensor` with data-parallel rank `src_rank`'s copy (blocking, not counted).

        Spans the whole data-parallel group, every shard group included.
        """
        if self.distributed:
            group = self.dp_group
            src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
            dist.broadcast(tensor, src=src, group=group)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Blocking all-reduce of a small tensor over the shard group (not counted: control
        traffic; replicas of a shard hold the same values, so one shard group sees all)."""
        if self.distributed:
            dist.all_reduce(value, group=self.group)
        return value
