"""The writer process: writes shard files from shared staging memory, one request at a time.

It writes straight from the mapped slab (no copy) and computes no checksum: the trainer's
staging copy did ([Note: the checksum rides on the staging copy] in `staging.py`).

Started by `writer_proc.WriterProcess` as `python -m ckpt_manager._save.writer --fd N` (a fresh
interpreter, like multiprocessing's spawn, but usable in daemonic rank processes). It never
imports torch: it only moves bytes, so it starts fast and stays small.

[Note: the writer starts without structlog] Nor structlog: the storage backends it imports
make their loggers at first use, so its start-up (every rank's, at every restart, beside the
restarted ranks' first steps on the same cores) does not pay structlog's import with `rich`:
0.20 -> 0.14 s of CPU on this 2-core VM (`python -c "import ckpt_manager._save.writer"`).

Protocol over a private Unix socket (`multiprocessing.connection.Connection`)::

    trainer -> writer  {"op": "slab", "slab_id", "size"} + the memfd (SCM_RIGHTS)
                       {"op": "write", "request_id", "step", "name", "slab_id", "nbytes",
                        "root_uri", "storage_options", "chunk_bytes", "concurrency",
                        "streamed", "retry_for_s", "index_json", "checksum",
                        "spread_prefixes"}
                        (index_json: the rank's pending index object, written after the
                        file with its size and `checksum`, the staging copy's, in its
                        sub-prefix when spread_prefixes is non-zero; `checksum` is None when
                        streamed: then it comes with the copy's last `staged` message)
                       {"op": "staged", "request_id", "upto" | "error" [, "checksum"]}
                        (streamed writes: the first `upto` bytes of the slab are final;
                        sent while copying)
                       {"op": "stop"}                         sentinel: exit 0
    writer -> trainer  {"op": "ready", "pid"}
                       {"op": "done", "request_id", "ok", "size", "index": [size, crc32],
                        "write_s", "error"}

A failed write is answered (`ok: false`) and the loop keeps serving. The writer exits when the
socket closes or its parent is gone, so it never outlives the trainer.

Fault injection for tests and chaos drills: `CKPT_MANAGER_WRITER_FAULT=<action>@<step>`
(optionally `@<step>@<rank>`), action `raise` (the write fails), `exit` (the process dies
mid-request), `stall=<seconds>` (a partial temp object is left, then the writer sleeps
before the real write) or `hold=<path>` (the same, until the local file `path` exists: a
drill decides when a writer outliving its rank writes). Several faults are separated by
commas (`raise@2,raise@4`). The name has no `TRAININGD_` prefix on purpose: `trainingd run`
rejects unknown `TRAININGD_*` variables, and a drill runs the writer under it.
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._store.indexes import write_finished_index
from ckpt_manager._store.storage import Storage

__all__ = ["FAULT_ENV", "main", "write_shard", "write_shard_retrying"]

FAULT_ENV = "CKPT_MANAGER_WRITER_FAULT"


def write_shard_retrying(
    storage: Storage,
    name: str,
    data: memoryview,
    *,
    chunk_bytes: int,
    concurrency: int,
    retry_for_s: float,
    on_retry: Callable[[BaseException, float], None] | None = None,
    index_json: str | None = None,
    checksum: int = 0,
    spread_prefixes: int = 0,
) -> tuple[int, FileEntry | None]:
    """`write_shard` to an object store, retried while the store is only unreachable; then
    the rank's index object (`index_json`: `indexes.write_finished_index`, recording the
    shard's size and its staged `checksum`), retried the same way within the same
    `retry_for_s`. Returns the shard's size and the index's entry (None without
    `index_json`).

    [Note: a store outage is waited out, not failed] botocore's own retries give up within
    seconds, so without this a restart of the object store or a network blip fails every
    save in flight, and `max_consecutive_save_failures` saves later the run. A transient
    failure of a remote store (`backend_errors.is_transient`: unreachable, timeouts,
    throttling, 5xx) is retried with backoff (1 s doubling to 30 s; `Storage.retrying`) for
    up to `retry_for_s`, which the trainer sets inside its `write_timeout_s`; refusals (4xx)
    and local-disk errors fail at once. The upload restarts from the first byte: parts of a
    failed attempt were aborted with it.

    Args:
        on_retry: called with the error and the delay before each retry (for logging).
    """
    deadline = time.monotonic() + retry_for_s
    size = storage.retrying(
        lambda: write_shard(storage, name, data, chunk_bytes=chunk_bytes, concurrency=concurrency),
        deadline=deadline,
        on_retry=on_retry,
    )
    if index_json is None:
        return size, None
    index = storage.retrying(
        lambda: write_finished_index(
            storage, index_json, size, checksum, spread_prefixes=spread_prefixes
        ),
        deadline=deadline,
        on_retry=on_retry,
    )
    return size, index


def write_shard(
    storage: Storage,
    name: str,
    data: memoryview,
    *,
    chunk_bytes: int,
    concurrency: int,
    staged: Iterable[int] | None = None,
) -> int:
    """Atomically write one shard file straight from `data` (the slab); returns its size.

    The checksum is not computed here: the trainer's staging copy computed it while the
    bytes were in cache ([Note: the checksum rides on the staging copy] in `staging.py`).
    With `staged` (the snapshot is still being copied into `data`; see `Storage.write`), each
    part is written as soon as it is final.
    """
    storage.write(name, data, chunk_bytes=chunk_bytes, concurrency=concurrency, staged=staged)
    return len(data)


def _apply_fault(
    specs: str, rank: int, step: int, storage: Storage, name: str, data: memoryview
) -> None:
    for spec in specs.split(","):
        _apply_one_fault(spec.strip(), rank, step, storage, name, data)


def _apply_one_fault(
    spec: str, rank: int, step: int, storage: Storage, name: str, data: memoryview
) -> None:
    parts = spec.split("@")
    if len(parts) < 2 or int(parts[1]) != step:
        return
    if len(parts) >= 3 and int(parts[2]) != rank:
        return
    action = parts[0]
    if action == "raise":
        raise RuntimeError(f"injected writer fault at step {step}")
    if action == "exit":
        os._exit(17)
    if action.startswith("stall="):
        storage.write(f"{name}.partial", bytes(data[: len(data) // 2]))
        time.sleep(float(action.removeprefix("stall=")))
    if action.startswith("hold="):
        storage.write(f"{name}.partial", bytes(data[: len(data) // 2]))
        while not os.path.exists(action.removeprefix("hold=")):
            time.sleep(0.05)


class _Server:
    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self.slabs: dict[int, mmap.mmap] = {}
        self.storages: dict[str, Storage] = {}
        self.fault = os.environ.get(FAULT_ENV, "")
        self.backlog: collections.deque[dict[str, Any]] = collections.deque()
        self.checksums: dict[int, int] = {}
        """Staged checksums of streamed writes, by request id (see `staged_checksum`)."""

    def storage(self, root_uri: str, options: dict[str, Any]) -> Storage:
        key = json.dumps([root_uri, options], sort_keys=True, default=str)
        found = self.storages.get(key)
        if found is None:
            found = self.storages[key] = Storage(root_uri, options)
        return found

    def add_slab(self, msg: dict[str, Any]) -> None:
        fd = reduction.recv_handle(self.conn)
        try:
            mm = mmap.mmap(fd, int(msg["size"]))
        finally:
            os.close(fd)
        old = self.slabs.pop(int(msg["slab_id"]), None)
        if old is not None:
            self.unmap(old)
        self.slabs[int(msg["slab_id"])] = mm

    def unmap(self, mm: mmap.mmap) -> None:
        """Unmap a slab, released by every store first (one that kept it pinned its pages)."""
        for storage in self.storages.values():
            storage.release_buffer(mm)
        mm.close()

    def write(self, msg: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        reply: dict[str, Any] = {"op": "done", "request_id": msg["request_id"]}
        try:
            storage = self.storage(msg["root_uri"], msg["storage_options"])
            slab = self.slabs[int(msg["slab_id"])]
            # Local disk pins its pages once for every direct write from it ([Note: direct
            # writes from registered buffers] in `_store/backends/uring.py`).
            storage.keep_buffer(slab)
            view = memoryview(slab)[: int(msg["nbytes"])]
            try:
                if self.fault:
                    _apply_fault(
                        self.fault, self.rank, int(msg["step"]), storage, msg["name"], view
                    )
                retries: list[str] = []
                spread = int(msg.get("spread_prefixes", 0))
                sizes = {
                    "chunk_bytes": int(msg["chunk_bytes"]),
                    "concurrency": int(msg["concurrency"]),
                }
                # The index last: it records the shard's size and checksum, and the trainer
                # reports its own size and CRC-32 to the coordinator ([Note: the top
                # manifest stays small] in `_format/manifest.py`).
                if msg.get("streamed"):  # local disk: nothing transient to wait out
                    staged = self.staged_counts(msg)
                    size = write_shard(storage, msg["name"], view, staged=staged, **sizes)
                    index = write_finished_index(
                        storage,
                        msg["index_json"],
                        size,
                        self.staged_checksum(msg),
                        spread_prefixes=spread,
                    )
                else:
                    size, written = write_shard_retrying(
                        storage,
                        msg["name"],
                        view,
                        retry_for_s=float(msg.get("retry_for_s", 0.0)),
                        on_retry=lambda err, _delay: retries.append(f"{type(err).__name__}: {err}"),
                        index_json=msg["index_json"],
                        checksum=int(msg["checksum"]),
                        spread_prefixes=spread,
                        **sizes,
                    )
                    assert written is not None
                    index = written
            finally:
                view.release()
            reply.update(ok=True, size=size, index=[index.size, index.crc32], error=None)
            if retries:
                reply.update(retries=len(retries), retried_error=retries[-1])
        except Exception as err:
            reply.update(ok=False, size=0, error=f"{type(err).__name__}: {err}")
        reply["write_s"] = time.monotonic() - started
        return reply

    def staged_counts(self, msg: dict[str, Any]) -> Iterator[int]:
        """The trainer's `staged` messages for a streamed write, as byte counts.

        Other messages arriving meanwhile wait in the backlog (a `slab` is taken at once:
        its fd follows it on the socket).

        Raises:
            RuntimeError: the trainer reports that the snapshot copy failed.
            EOFError: the trainer is gone.
        """
        request_id, total = msg["request_id"], int(msg["nbytes"])
        while True:
            got = self.conn.recv()
            if got.get("op") == "slab":
                self.add_slab(got)
                continue
            if got.get("op") != "staged" or got.get("request_id") != request_id:
                self.backlog.append(got)
                continue
            if got.get("error"):
                raise RuntimeError(f"snapshot copy failed in the trainer: {got['error']}")
            count = int(got["upto"])
            if "checksum" in got:  # the copy's last word, after every byte was staged
                self.checksums[request_id] = int(got["checksum"])
                yield count
                return
            yield count
            if count >= total:
                return

    def staged_checksum(self, msg: dict[str, Any]) -> int:
        """The staged file's checksum for a streamed write: the trainer sends it once its
        copy (which computes it) is done, possibly after the last byte count was taken.

        Raises:
            RuntimeError: the trainer reports that the snapshot copy failed.
            EOFError: the trainer is gone.
        """
        request_id = msg["request_id"]
        while request_id not in self.checksums:
            for _ in self.staged_counts(msg):
                pass
        return self.checksums.pop(request_id)

    def next_message(self, parent_pid: int) -> dict[str, Any] | None:
        """The next request (backlog first); None once the trainer is gone."""
        if self.backlog:
            return self.backlog.popleft()
        while not self.conn.poll(1.0):
            if os.getppid() != parent_pid:
                return None
        try:
            msg: dict[str, Any] = self.conn.recv()
        except EOFError:
            return None
        return msg

    def serve(self, parent_pid: int) -> int:
        self.conn.send({"op": "ready", "pid": os.getpid()})
        while True:
            msg = self.next_message(parent_pid)
            if msg is None:
                return 0
            op = msg.get("op")
            if op == "stop":
                return 0
            if op == "slab":
                self.add_slab(msg)
            elif op == "drop_slab":
                old = self.slabs.pop(int(msg["slab_id"]), None)
                if old is not None:
                    self.unmap(old)
            elif op == "write":
                self.conn.send(self.write(msg))
            elif op == "staged":
                pass  # progress of a streamed write that failed before reading it all
            else:
                raise ValueError(f"unknown writer request {op!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the writer process; returns the exit code."""
    parser = argparse.ArgumentParser(prog="ckpt_manager._save.writer", allow_abbrev=False)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    try:
        return _Server(conn, args.rank).serve(args.parent_pid)
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
