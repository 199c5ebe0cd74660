"""`PrefetchingLoader`: the next batches are read on a background thread, off the step's path.

Reading a batch may mean range reads from S3 (`daemon/data/`); on the training thread that
time would be added to every step. One thread owned by this object runs the wrapped
`ShardedLoader` ahead, `depth` batches at most (a bounded queue), and the training thread takes
them in order; the step's wait for its batches is what `trainingd_train_data_loading_seconds`
then measures (close to zero when storage keeps up).

[Note: the prefetched position]
The loader's own position runs ahead by the queued batches; a checkpoint must hold the
position of what the *training* thread consumed. Each queued batch carries the loader's
position just after it was read, and `state_dict()` is the position of the last batch handed
out. `load_state_dict()` stops the thread, drops what it read ahead, moves the loader and
starts again on the next `next_batch()`, so resuming reads exactly the batches an unprefetched
loader would.

Errors of the thread resurface on the training thread's next `next_batch()` (after the batches
read before the error), and every wait has a timeout (`STYLE.md` 11).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, NamedTuple

import torch

from daemon.rank.batch import Batch
from daemon.rank.data import ShardedLoader

__all__ = ["PrefetchingLoader"]

_POLL_S = 0.1


class _Read(NamedTuple):
    batch: Batch
    position: dict[str, Any]


class PrefetchingLoader:
    """A `ShardedLoader` read `depth` batches ahead on one background thread.

    Args:
        loader: the loader it runs (used by that thread only while it runs).
        depth: batches read ahead; 0 reads on the calling thread (no thread).
        device: a CUDA device makes it the thread's current device (pinned buffers of a rank
            are then allocated for its own GPU, not a context on GPU 0).
        timeout_s: the longest a `next_batch()` waits for one batch before it fails.
    """

    def __init__(
        self,
        loader: ShardedLoader,
        *,
        depth: int,
        device: torch.device | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._loader = loader
        self._depth = depth
        self._device = device
        self._timeout_s = timeout_s
        self._position = loader.state_dict()
        self._queue: queue.Queue[_Read] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- the thread ---------------------------------------------------------------------------
    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._depth)
        self._error = None
        self._thread = threading.Thread(
            target=self._produce, args=(self._stop, self._queue), name="trainingd-prefetch"
        )
        self._thread.daemon = True  # a hung storage read must not keep the rank alive
        self._thread.start()

    def _produce(self, stop: threading.Event, out: queue.Queue[_Read]) -> None:
        try:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            while not stop.is_set():
                read = _Read(self._loader.next_batch(), self._loader.state_dict())
                while not stop.is_set():
                    try:
                        out.put(read, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # resurfaces on the training thread's next call
            self._error = err

    def close(self) -> None:
        """Stop the thread and drop what it read ahead (the position stays as consumed)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=self._timeout_s)

    def __enter__(self) -> PrefetchingLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loader's interface ---------------------------------------------------------------
    def next_batch(self) -> Batch:
        """This rank's next micro-batch (`ShardedLoader.next_batch`).

        Raises:
            TimeoutError: no batch within `timeout_s`.
            Exception: whatever reading a batch raised, on the background thread.
        """
        if self._depth == 0:
            batch = self._loader.next_batch()
            self._position = self._loader.state_dict()
            return batch
        if self._thread is None:
            self._start()
        assert self._thread is not None
        waited = 0.0
        while True:
            try:
                read = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                if not self._thread.is_alive():
                    self._thread = None
                    error, self._error = self._error, None
                    if error is not None:
                        raise error from None
                    raise RuntimeError("the data prefetch thread ended without an error") from None
                if waited >= self._timeout_s:
                    raise TimeoutError(
                        f"no batch from the data prefetch thread in {self._timeout_s:.0f} s"
                    ) from None
        self._position = read.position
        return read.batch

    def state_dict(self) -> dict[str, Any]:
        """The position of the batches handed out so far (see [Note: the prefetched position])."""
        return dict(self._position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by `state_dict` (at any world size)."""
        self.close()
        self._loader.load_state_dict(state)
        self._position = self._loader.state_dict()
