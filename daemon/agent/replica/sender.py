"""The replica sender: streams every complete snapshot of this node's ranks to the next node
(but those its rank keeps on this node: `SlotMeta.replicate` False).

One thread in the daemon process (the ranks are not involved and never wait for it). It
watches the memory tier's directory (woken by a meta renamed into it: [Note: the sender wakes
on a new meta] in `watch.py`) for the newest complete snapshot of each local rank, i.e. a meta
that parses and verifies, and streams the newest one the peer has not acknowledged: a newer
snapshot supersedes an older unsent one, so nothing queues. A payload
leaves with `sendfile` from the slot file, a large one striped over `memory_replica_streams`
connections ([Note: replica payloads go over parallel streams]); if the rank empties that
slot meanwhile (its slot is reused two snapshots later), the transfer ends with `ABORT` and
the next tick sends the newer snapshot. A broken connection is counted, logged once per kind
and retried on the next tick after `RETRY_S`; replication never stops or slows training.

[Note: a replica costs one parse at each end] A meta is the bulk of a replica's Python work:
49 KB of JSON for the default job (a record per tensor, the state's skeleton), against a 5 MB
payload that `sendfile` and `recv_into` move without the GIL. Each replica used to be parsed
and re-encoded about a dozen times between the two daemons (parsed with its self-checksum by
re-encoding it, sent inside a JSON frame, every slot's meta parsed again to see whether its
slot changed, the receiver's slots parsed again on every put, the stamped copy encoded twice
and parsed again). Profiled on the default job at `memory_every 1` on two nodes x 1 rank
(py-spy, 200 Hz, 10 s), the sender thread was busy 31% of a core and the receiving
connection's thread 28%, nearly all of it in `json`, and a replica's meta landed 59 ms after
its snapshot's at the median and 295 ms at worst (timed from outside: `bench/replica_lag.py`):
more than two of the job's 80-100 ms steps, so a node loss could cost 3 steps. Now a meta's
bytes are parsed once where they are read (`MetaReader`: once per file version), checked on
those bytes ([Note: a signed meta's text is checked as it is] in
`ckpt_manager/_memory/meta.py`), sent as those bytes after the put's frame, compared as bytes
to tell an unchanged slot, and stamped with one encoding at the receiver.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import structlog

from ckpt_manager.memory_slots import MetaReader, ParsedMeta, SlotFiles, SlotMeta
from daemon.agent.replica.protocol import (
    ABORT,
    COMMIT,
    ProtocolError,
    Refusal,
    await_receipt,
    configure,
    recv_frame,
    send_file,
    send_meta,
)
from daemon.agent.replica.server import IO_TIMEOUT_S
from daemon.agent.replica.stats import ReplicaStats
from daemon.agent.replica.stripes import StripeSender, stripe_count, stripe_ranges
from daemon.agent.replica.watch import NewFiles

__all__ = ["RETRY_S", "ReplicaSender", "Ring", "parse_address"]

log = structlog.get_logger("trainingd.replica")

RETRY_S = 1.0
"""Pause after a failed connection or transfer before the next attempt."""


class Ring(NamedTuple):
    """Where this node's snapshots go in the current membership round."""

    round: int
    """The membership round (`peers.py`)."""
    target: str | None
    """`host:port` of the next node's replica server (None: no peer, nothing is sent)."""
    ranks: tuple[int, ...]
    """This node's global ranks in the round."""


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) -> `(host, port)`.

    Raises:
        ValueError: no port, or a port that is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"replica address {address!r}: use host:port")
    return host.strip("[]"), int(port)


class ReplicaSender:
    """The sending thread (owned by `ReplicaService`).

    Args:
        tier_dir: this node's memory-tier directory (the ranks' slot files).
        run_id: this run.
        node: this node's rank (the receiver tracks rounds per sender).
        stats: the counters.
        streams: connections a large payload is striped over (`memory_replica_streams`,
            [Note: replica payloads go over parallel streams]).
    """

    def __init__(
        self, tier_dir: str, run_id: str, node: int, stats: ReplicaStats, streams: int = 1
    ) -> None:
        self._dir, self._run_id, self._node, self._stats = tier_dir, run_id, node, stats
        self._streams = streams
        self._ring = Ring(0, None, ())
        # Per rank, the newest step acknowledged or refused by the peer: never sent again.
        self._done: dict[int, int] = {}
        self._lock = threading.Lock()
        self._watch = NewFiles(tier_dir)
        self._closed = threading.Event()
        self._metas = MetaReader()
        self._former: tuple[tuple[int, ...], float] = ((), 0.0)
        self._sock: socket.socket | None = None
        self._sock_target: str | None = None
        self._stripes: StripeSender | None = None
        self._thread = threading.Thread(
            target=self._run, name="trainingd-replica-sender", daemon=True
        )
        self._thread.start()

    def set_ring(self, ring: Ring, *, former: Sequence[int] = ()) -> None:
        """A new round: send to `ring.target` from now on (acknowledgements of another target
        no longer count).

        Args:
            ring: the round's ring.
            former: ranks whose slots this node still holds from an earlier round
                ([Note: group ranks move between nodes]): removed once a rank of this round
                wrote a snapshot, which happens only after every rank's restore agreement,
                so after every peer that needed them fetched them.
        """
        with self._lock:
            self._former = (tuple(former), time.time())
            if ring.target != self._ring.target or ring.target is None:
                self._done.clear()
                # Without a peer there is no lag to report.
                self._stats.forget_acks(list(ring.ranks) if ring.target is not None else [])
            self._ring = ring
        self._watch.wake()

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._closed.set()
        self._watch.wake()
        self._thread.join(timeout=IO_TIMEOUT_S + 5)
        self._disconnect()
        if not self._thread.is_alive():
            self._watch.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._closed.is_set():
            self._watch.wait()
            with self._lock:
                ring = self._ring
            self._drop_former(ring)
            if ring.target is None:
                continue
            for rank in ring.ranks:
                if self._closed.is_set():
                    return
                newest = self._newest(rank)
                if newest is None:
                    continue
                slot, parsed = newest
                meta = parsed.meta
                self._stats.local_step(rank, meta.step)
                if meta.step <= self._done.get(rank, -1):
                    continue
                try:
                    self._send(ring, rank, slot, parsed)
                except (OSError, ProtocolError) as err:
                    self._disconnect()
                    detail = f"{type(err).__name__}: {err}"
                    self._stats.failed(
                        Refusal.CONNECTION,
                        "replica_send_failed",
                        target=ring.target,
                        rank=rank,
                        step=meta.step,
                        error=detail,
                    )
                    # A new ring (`set_ring`, e.g. the lost peer's replacement) or `close`
                    # ends the pause at once.
                    self._watch.wait(files=False, timeout_s=RETRY_S)
                    break

    def _drop_former(self, ring: Ring) -> None:
        """Remove the former ranks' slots once a rank of this round snapshotted (`set_ring`)."""
        with self._lock:
            former, since = self._former
        if not former:
            return
        for rank in ring.ranks:
            newest = self._newest(rank, for_ring=False)
            if newest is None:
                continue
            with contextlib.suppress(OSError):
                if os.stat(SlotFiles(self._dir, rank).meta_path(newest[0])).st_mtime > since:
                    break
        else:
            return
        for rank in former:
            files = SlotFiles(self._dir, rank)
            for slot in files.existing_slots():
                files.remove_meta(slot)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(files.payload_path(slot))
        log.info("replica_former_slots_dropped", ranks=list(former))
        with self._lock:
            if self._former[1] == since:
                self._former = ((), 0.0)

    def _newest(self, rank: int, *, for_ring: bool = True) -> tuple[int, ParsedMeta] | None:
        """The rank's newest complete snapshot of this run: `(slot, its meta)` (a meta is
        parsed once per file version: `MetaReader`). With `for_ring`, one its rank keeps on
        this node (`SlotMeta.replicate` False: [Note: under `auto` a durable save between two
        snapshots stays on its node] in `daemon/rank/memory_cadence.py`) is passed over."""
        best: tuple[int, ParsedMeta] | None = None
        for slot, parsed in self._metas.complete(SlotFiles(self._dir, rank)).items():
            meta = parsed.meta
            if meta.run_id != self._run_id or meta.rank != rank:
                continue
            if for_ring and not meta.replicate:
                continue
            if best is None or meta.step > best[1].meta.step:
                best = (slot, parsed)
        return best

    def _connect(self, target: str) -> tuple[socket.socket, StripeSender]:
        if self._sock is not None and self._stripes is not None and self._sock_target == target:
            return self._sock, self._stripes

        def connect() -> socket.socket:
            sock = socket.create_connection(parse_address(target), timeout=IO_TIMEOUT_S)
            configure(sock, IO_TIMEOUT_S)
            return sock

        self._disconnect()
        sock = connect()
        try:
            stripes = StripeSender(connect, self._streams - 1)
        except BaseException:
            sock.close()
            raise
        self._sock, self._stripes, self._sock_target = sock, stripes, target
        return sock, stripes

    def _disconnect(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._stripes is not None:
            self._stripes.close()
        self._sock, self._stripes, self._sock_target = None, None, None

    def _send(self, ring: Ring, rank: int, slot: int, parsed: ParsedMeta) -> None:
        assert ring.target is not None
        meta = parsed.meta
        files = SlotFiles(self._dir, rank)
        try:
            fd = os.open(files.payload_path(slot), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # the slot went away (the run moved on); the next tick sees the newer one
        try:
            sock, stripes = self._connect(ring.target)
            seq = stripes.next_seq()
            request = {
                "op": "put",
                "run_id": self._run_id,
                "round": ring.round,
                "node": self._node,
                "stripes": stripe_count(meta.payload_bytes, stripes.streams),
                "session": stripes.session,
                "seq": seq,
            }
            send_meta(sock, request, parsed.data)
            reply = recv_frame(sock)
            if not self._accepted(reply, rank, meta):
                return
            assert reply is not None
            # A receiver without stripes says nothing: all on this connection.
            try:
                count = int(reply.get("stripes", 1))
            except (TypeError, ValueError) as err:
                raise ProtocolError(f"a go-ahead for {reply.get('stripes')!r} stripes") from err
            ranges = stripe_ranges(meta.payload_bytes, count)
            t0 = time.perf_counter()
            parts = stripes.start(fd, ranges, seq)
            failed = True
            try:
                send_file(sock, fd, ranges[0][1])
                failed = False
            finally:
                stripes.finish(parts, abort=failed)  # before the file is closed under them
            await_receipt(sock, meta.payload_bytes)
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
        # The rank empties a slot's meta before it overwrites it: a meta unchanged until the
        # receiver holds every byte means the bytes it holds are the snapshot's ([Note: a sent
        # page is read when the peer reads it] in `protocol.py`).
        unchanged = _file_bytes(files.meta_path(slot)) == parsed.data
        sock.sendall(COMMIT if unchanged else ABORT)
        if self._accepted(recv_frame(sock), rank, meta):
            self._stats.sent(meta.payload_bytes, seconds)
            self._done[rank] = meta.step
            self._stats.acked_step(rank, meta.step)

    def _accepted(self, reply: dict[str, Any] | None, rank: int, meta: SlotMeta) -> bool:
        if reply is None:
            raise ProtocolError("the receiver closed the connection")
        if reply.get("ok") is True:
            return True
        reason = str(reply.get("reason"))
        if reason == "superseded":
            return False  # a newer snapshot took the slot mid-send: the next tick sends it
        try:
            refusal = Refusal(reason)
        except ValueError:
            refusal = Refusal.PROTOCOL
        detail = str(reply.get("detail"))
        self._stats.failed(
            refusal, "replica_send_refused", rank=rank, step=meta.step, detail=detail
        )
        # Not retried at once: the same snapshot would be refused the same way.
        self._done[rank] = max(self._done.get(rank, -1), meta.step)
        return False


def _file_bytes(path: str) -> bytes | None:
    """A file's bytes (None: it is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
