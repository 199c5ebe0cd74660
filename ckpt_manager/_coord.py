"""Checkpoint collectives on a dedicated gloo group (never the training group).

[Note: why a dedicated group] Checkpoint agreement runs on CPU tensors at step boundaries;
sharing the (NCCL or gloo) training group would interleave with training collectives and
deadlock when one side blocks (KempnerForge#104). The group is created once by the manager
(a collective: every rank constructs the manager) with the finalize timeout, so every
collective here fails with an error instead of hanging when a peer is dead or stuck.

With no process group (a single process) every call is local and trivial.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, NamedTuple

import torch

from ckpt_manager.errors import CheckpointError, CheckpointTimeoutError

__all__ = ["Agreement", "Coordinator", "Status"]


class Status:
    """Local save states, ordered so MAX picks the one that matters."""

    OK = 0
    """This rank's files are durable."""
    WRITING = 1
    """Still staging or writing."""
    FAILED = 2
    """Failed here; dominates so no rank waits on a failed peer."""


class Agreement(NamedTuple):
    """Result of one agreement round."""

    status: int
    """MAX of the local statuses."""
    consistent: bool
    """Every rank named the same request."""


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

    def agree(self, request_id: int, status: int) -> Agreement:
        """MAX-reduce `[status, id, -id]`: the worst status, and whether all ids match."""
        if self._group is None:
            return Agreement(status, True)
        t = torch.tensor([status, request_id, -request_id], dtype=torch.int64)
        try:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as err:
            raise self._guard("agreement", err) from err
        return Agreement(int(t[0]), int(t[1]) == -int(t[2]) == request_id)

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

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's object on the coordinator (None elsewhere)."""
        if self._group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        try:
            self._dist.gather_object(obj, out, dst=0, group=self._group)
        except RuntimeError as err:
            raise self._guard("gather", err) from err
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
