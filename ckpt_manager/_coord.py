"""Checkpoint collectives on a dedicated gloo group (never the training group).

[Note: why a dedicated group] Checkpoint agreement runs on CPU tensors at step boundaries;
sharing the (NCCL or gloo) training group would interleave with training collectives and
deadlock when one side blocks (KempnerForge#104). The group is created once by the manager
(a collective: every rank constructs the manager) with the finalize timeout, so every
collective here fails with an error instead of hanging when a peer is dead or stuck.

[Note: collectives the training thread does not wait for] `max_async`, `gather_bytes_async`
and `all_gather_bytes_async` issue a collective with `async_op=True` and return a `Pending`
handle: `ready()` never blocks (it asks the work whether it completed), `result()` waits
(bounded by the group timeout) and raises the same `CheckpointError` a blocking call would.
The group timeout still holds: gloo completes a work that outlives it with a timeout error (a
dead peer's work with a connection error, at once), and `ready()` also turns True once the
timeout (plus a grace) has passed, so a caller that polls learns of it on its next call. A
caller that issues async collectives must issue every collective of that group in the same
order on every rank, so the finalizer has a group of its own (the manager makes one
`Coordinator` for it, one for start-up and restore): a restore's collectives never
interleave with a poll in flight.

With no process group (a single process) every call is local and trivial.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

import torch

from ckpt_manager.errors import CheckpointError, CheckpointTimeoutError

__all__ = ["Coordinator", "Pending", "Status"]

T = TypeVar("T")

_LENGTH_BYTES = 8  # the length prefix of each rank's payload in `gather_bytes_async`
_DEADLINE_GRACE_S = 1.0  # past the group timeout before `Pending.ready()` gives up on gloo


class Status:
    """Local save states, ordered so MAX picks the one that matters."""

    OK = 0
    """This rank's files are durable."""
    WRITING = 1
    """Still staging or writing."""
    FAILED = 2
    """Failed here; dominates so no rank waits on a failed peer."""


class Pending(Generic[T]):
    """A collective issued without waiting ([Note: collectives the training thread does not
    wait for])."""

    def __init__(self, coord: Coordinator, what: str, work: Any, finish: Callable[[], T]) -> None:
        """Wrap `work` (None: already done locally); `finish` reads its result once complete."""
        self._coord = coord
        self._what = what
        self._work = work
        self._finish = finish
        self._deadline = time.monotonic() + coord.timeout_s + _DEADLINE_GRACE_S

    def ready(self) -> bool:
        """True once `result()` returns (or raises) without waiting; never blocks."""
        return (
            self._work is None
            or bool(self._work.is_completed())
            or time.monotonic() > self._deadline
        )

    def result(self) -> T:
        """The collective's result; waits for it if needed (bounded by the group timeout).

        Raises:
            CheckpointTimeoutError: it did not complete within the group timeout.
            CheckpointError: it failed (a peer died).
        """
        if self._work is not None:
            if not self._work.is_completed() and time.monotonic() > self._deadline:
                raise CheckpointTimeoutError(
                    f"checkpoint {self._what} on rank {self._coord.rank} did not complete "
                    f"within {self._coord.timeout_s:.0f} s (a peer is dead or stuck)"
                )
            try:
                self._work.wait()
            except RuntimeError as err:
                raise self._coord._guard(self._what, err) from err
        return self._finish()


class Coordinator:
    """Rank identity plus the collectives the manager needs, each bounded by the timeout."""

    def __init__(self, timeout_s: float) -> None:
        """Join the default process group's ranks in a new gloo group (collective).

        Args:
            timeout_s: limit of each collective.
        """
        import torch.distributed as dist

        self._dist = dist
        self.timeout_s = timeout_s
        """Limit of each collective."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank = dist.get_rank()
            """This rank."""
            self.world_size = dist.get_world_size()
            """Ranks in the run."""
            self._group: Any = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        else:
            self.rank = 0
            self.world_size = 1
            self._group = None

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 writes manifests, holds the lease and deletes."""
        return self.rank == 0

    def _guard(self, what: str, err: BaseException) -> CheckpointError:
        text = str(err)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return CheckpointTimeoutError(
                f"checkpoint {what} on rank {self.rank} did not complete within "
                f"{self.timeout_s:.0f} s (a peer is dead or stuck): {text}"
            )
        return CheckpointError(f"checkpoint {what} failed on rank {self.rank}: {text}")

    def max_async(self, values: Sequence[int]) -> Pending[list[int]]:
        """Issue an element-wise MAX all-reduce of int64 `values`; read it later.

        Raises:
            CheckpointError: the collective could not be issued (the group is broken).
        """
        if self._group is None:
            local = list(values)
            return Pending(self, "poll", None, lambda: local)
        t = torch.tensor(list(values), dtype=torch.int64)
        try:
            work = self._dist.all_reduce(
                t, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True
            )
        except RuntimeError as err:
            raise self._guard("poll", err) from err
        return Pending(self, "poll", work, t.tolist)

    def gather_bytes_async(self, payload: bytes, size: int) -> Pending[list[bytes] | None]:
        """Issue a gather of every rank's `payload` (each at most `size` bytes, which every
        rank passes alike) to the coordinator; read it later: the payloads by rank on the
        coordinator, None elsewhere.

        Raises:
            ValueError: `payload` is longer than `size`.
            CheckpointError: the collective could not be issued (the group is broken).
        """
        return self._bytes_async(payload, size, everyone=False)

    def all_gather_bytes_async(self, payload: bytes, size: int) -> Pending[list[bytes]]:
        """Issue an all-gather of every rank's `payload` (each at most `size` bytes, which
        every rank passes alike); read it later: the payloads by rank, on every rank.

        Raises:
            ValueError: `payload` is longer than `size`.
            CheckpointError: the collective could not be issued (the group is broken).
        """
        return cast("Pending[list[bytes]]", self._bytes_async(payload, size, everyone=True))

    def _bytes_async(
        self, payload: bytes, size: int, *, everyone: bool
    ) -> Pending[list[bytes] | None]:
        if len(payload) > size:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the agreed {size}")
        what = "all_gather" if everyone else "gather"
        if self._group is None:
            return Pending(self, what, None, lambda: [payload])
        # Fixed-size buffers (gloo gathers equal sizes): a length prefix, the payload, zeros.
        framed = len(payload).to_bytes(_LENGTH_BYTES, "little") + payload
        buf = torch.zeros(size + _LENGTH_BYTES, dtype=torch.uint8)
        buf[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
        receives = everyone or self.is_coordinator
        outs = [torch.empty_like(buf) for _ in range(self.world_size)] if receives else None
        try:
            if everyone:
                work = self._dist.all_gather(outs, buf, group=self._group, async_op=True)
            else:
                work = self._dist.gather(buf, outs, dst=0, group=self._group, async_op=True)
        except RuntimeError as err:
            raise self._guard(what, err) from err

        def unframe() -> list[bytes] | None:
            if outs is None:
                return None
            got = []
            for out in outs:
                raw = out.numpy().tobytes()
                n = int.from_bytes(raw[:_LENGTH_BYTES], "little")
                got.append(raw[_LENGTH_BYTES : _LENGTH_BYTES + n])
            return got

        return Pending(self, what, work, unframe)

    def max_flag(self, flag: int) -> int:
        """MAX of an integer over ranks."""
        if self._group is None:
            return flag
        t = torch.tensor([flag], dtype=torch.int64)
        try:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as err:
            raise self._guard("reduction", err) from err
        return int(t[0])

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's object, by rank (objects are our own small dicts)."""
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            self._dist.all_gather_object(out, obj, group=self._group)
        except RuntimeError as err:
            raise self._guard("all_gather", err) from err
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's object on every rank."""
        if self._group is None:
            return obj
        box = [obj]
        try:
            self._dist.broadcast_object_list(box, src=0, group=self._group)
        except RuntimeError as err:
            raise self._guard("broadcast", err) from err
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (bounded by the group timeout)."""
        self.max_flag(0)

    def destroy(self) -> None:
        """Release the group (best effort; the default group may already be gone)."""
        if self._group is not None and self._dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                self._dist.destroy_process_group(self._group)
        self._group = None
