"""Device-to-host staging of CUDA tensors: a pinned slab, a dedicated copy stream, events.

[Note: CUDA staging] On CPU the staging thread copies the snapshot while the loop runs forward
and backward, and `before_optimizer_step()` waits for the copy on the host. On CUDA the same
overlap needs the copy to run on the GPU's copy engine beside the compute:
  1. `save()` (training thread) records `ready` on the compute stream: the snapshot's values
     are those the GPU has produced once it gets there.
  2. The staging thread page-locks the slab (once: slabs are reused, `Slab.pin`), makes a
     dedicated copy stream wait for `ready` and enqueues every device-to-host copy on it with
     `non_blocking=True`, straight into the shared-memory slab the writer reads (no second
     host copy), then records `done` and signals `enqueued`. It then blocks, itself, on the
     copy's events, reporting progress to a streaming writer as parts land.
  3. `before_optimizer_step()` (training thread) waits on the host only until the copies are
     enqueued (the staging thread's own latency, not the copy's), then makes the compute
     stream wait for `done`: the optimizer's kernels run after the copy has read the old
     values, and the host never synchronizes the device.
Lifetimes: the request holds its tensors until the staging thread has seen `done` complete, so
a temporary of the state dict cannot be freed (and reused by the compute stream) while the
copy stream still reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckpt_manager._format.shard_file import FileLayout
from ckpt_manager._save.staging import Slab, copy_into_slot

__all__ = ["DeviceFence", "copy_to_pinned_slab"]


@dataclasses.dataclass(kw_only=True)
class DeviceFence:
    """The CUDA events of one save's device-to-host copy (see [Note: CUDA staging])."""

    device: torch.device
    """The GPU the snapshot's tensors live on."""
    ready: Any
    """`torch.cuda.Event` recorded on the compute stream at `save()`."""
    enqueued: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once the copies are enqueued (or the staging job ended without them)."""
    done: Any = None
    """`torch.cuda.Event` recorded on the copy stream after the last copy (None: no copy)."""

    @classmethod
    def after_current_work(cls, tensors: Sequence[Any]) -> DeviceFence | None:
        """A fence for `tensors` if any is on CUDA (None: a CPU snapshot, nothing to fence)."""
        device = next(
            (t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None
        )
        if device is None:
            return None
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(device))
        return cls(device=device, ready=ready)

    def order_compute_after_copy(self) -> None:
        """Make the current stream wait for the copy (a stream wait: the host goes on)."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)


@functools.cache
def _copy_stream(device: torch.device) -> Any:
    # One per GPU for the process: created once, reused by every save.
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def copy_to_pinned_slab(
    slab: Slab,
    layout: FileLayout,
    tensors: Sequence[torch.Tensor],
    fence: DeviceFence,
    on_progress: Callable[[int], None] | None = None,
    progress_bytes: int = 32 << 20,
) -> None:
    """`copy_into_slab` for a snapshot with CUDA tensors (see [Note: CUDA staging]).

    Returns once every byte is in the slab; `fence.enqueued` is set before that, as soon as
    the copies are on the copy stream.
    """
    # The staging thread's current device is 0 unless set: make it the snapshot's GPU.
    with torch.cuda.device(fence.device):
        _copy_on_stream(slab, layout, tensors, fence, on_progress, progress_bytes)


def _copy_on_stream(
    slab: Slab,
    layout: FileLayout,
    tensors: Sequence[torch.Tensor],
    fence: DeviceFence,
    on_progress: Callable[[int], None] | None,
    progress_bytes: int,
) -> None:
    buf = slab.tensor
    if buf is None:
        raise RuntimeError(f"staging buffer {slab.slab_id} is closed")
    slab.pin()
    header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    stream = _copy_stream(fence.device)
    marks: list[tuple[int, Any]] = []
    marked = 0
    with torch.no_grad():
        buf[: len(layout.header)].copy_(header)
        stream.wait_event(fence.ready)
        with torch.cuda.stream(stream):
            for slot, tensor in zip(layout.slots, tensors, strict=True):
                if slot.nbytes == 0:
                    continue
                copy_into_slot(buf, slot, tensor, non_blocking=True)
                end = slot.offset + slot.nbytes
                if on_progress is not None and end - marked >= progress_bytes:
                    mark = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    mark.record(stream)
                    marks.append((end, mark))
                    marked = end
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
    fence.done = done
    fence.enqueued.set()
    # Only this (staging) thread blocks on the copy, part by part for a streaming writer.
    for end, mark in marks:
        mark.synchronize()
        assert on_progress is not None
        on_progress(end)
    done.synchronize()
    if on_progress is not None and marked < layout.total_bytes:
        on_progress(layout.total_bytes)
