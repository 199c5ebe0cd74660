"""The replica server: receives peers' snapshots, serves what it holds to a fetching node.

One listening socket on `memory_replica_address`, one thread per connection (a node has one
sender streaming to it, plus a fetching node after a node loss). Requests are those of
`protocol.py`:

- `put` is refused, before any payload byte is sent, when the replica belongs to another run
  (`foreign_run`), comes from a membership round older than the newest accepted from that
  sender (`stale_round`), its meta does not verify (`checksum`) or the tmpfs has no room
  (`no_space`); each refusal is logged with its reason and counted. Accepted bytes land in the
  mapped slot file (`holdings.py`), the payload's checksum is verified, then its meta is
  written and the put acknowledged.
- `list` answers the complete replicas it holds of the asked ranks, and the shared-layout
  fingerprints of this node's own snapshots (the fetching node checks a replica against them).
- `part` carries one stripe of a put on another connection of its sender (`stripes.py`).
- `get` streams one held replica (`sendfile`), with the trailer saying whether its slot stayed
  unchanged during the send.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import structlog

from ckpt_manager import CheckpointError
from ckpt_manager.memory_slots import SlotFiles, SlotMeta, parse_meta_file, verify_slot
from daemon.agent.replica.holdings import ReplicaHoldings, complete_slots
from daemon.agent.replica.protocol import (
    ABORT,
    COMMIT,
    ProtocolError,
    Refusal,
    await_receipt,
    configure,
    recv_frame,
    recv_meta,
    recv_payload,
    send_file,
    send_frame,
)
from daemon.agent.replica.stats import ReplicaStats
from daemon.agent.replica.stripes import MAX_STRIPES, StripeBoard, StripedFill, stripe_ranges

__all__ = ["IO_TIMEOUT_S", "ReplicaServer"]

log = structlog.get_logger("trainingd.replica")

IO_TIMEOUT_S = 60.0
"""Longest wait for one frame or one chunk of a payload before a connection is dropped."""


class ReplicaServer:
    """Accepts replica connections on a background thread (owned by `ReplicaService`).

    Args:
        holdings: where replicas are held.
        local_dir: this node's memory-tier directory (its own ranks' slots, for `list`).
        stats: the counters.
        host: address to bind.
        port: port to bind (0: a free one).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(
        self,
        holdings: ReplicaHoldings,
        local_dir: str,
        stats: ReplicaStats,
        host: str,
        port: int,
    ) -> None:
        self._holdings = holdings
        self._local_dir = local_dir
        self._stats = stats
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        """The bound port."""
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._board = StripeBoard()
        self._thread = threading.Thread(
            target=self._accept, name="trainingd-replica-server", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and drop every connection (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            configure(conn, IO_TIMEOUT_S)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve,
                args=(conn, f"{peer[0]}:{peer[1]}"),
                name="trainingd-replica-conn",
                daemon=True,
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            while not self._closed.is_set():
                request = recv_frame(conn)
                if request is None:
                    return
                op = request.get("op")
                if op == "put":
                    self._put(conn, request, peer)
                elif op == "list":
                    self._list(conn, request)
                elif op == "get":
                    self._get(conn, request)
                elif op == "part":
                    self._part(conn, request)
                else:
                    self._refuse(conn, Refusal.PROTOCOL, f"unknown op {op!r}", peer)
        except (OSError, ProtocolError) as err:
            if not self._closed.is_set():
                log.info("replica_connection_closed", peer=peer, error=str(err))
        except Exception as err:  # one connection's failure is one line, never the server's
            log.error("replica_connection_failed", peer=peer, error=f"{type(err).__name__}: {err}")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _refuse(self, conn: socket.socket, reason: Refusal, detail: str, peer: str) -> None:
        self._stats.failed(reason, "replica_refused", detail=detail, peer=peer)
        send_frame(conn, {"ok": False, "reason": reason.value, "detail": detail})

    # ------------------------------------------------------------------ put
    def _put(self, conn: socket.socket, request: dict[str, Any], peer: str) -> None:
        holdings = self._holdings
        if "meta_bytes" not in request:
            detail = "a put without meta_bytes (its meta inside the frame: another version)"
            self._refuse(conn, Refusal.PROTOCOL, detail, peer)
            return
        data = recv_meta(conn, request)
        try:
            run_id, round_, node = (
                str(request["run_id"]),
                int(request["round"]),
                int(request["node"]),
            )
            parsed = parse_meta_file(data)
            meta = parsed.meta
        except (KeyError, TypeError, ValueError) as err:
            reason = Refusal.CHECKSUM if "checksum" in str(err) else Refusal.PROTOCOL
            self._refuse(conn, reason, f"a put whose meta does not parse: {err}", peer)
            return
        what = f"rank {meta.rank} step {meta.step} from node {node} (round {round_})"
        if run_id != holdings.run_id or meta.run_id != holdings.run_id:
            detail = f"{what}: run {meta.run_id!r}, not this run {holdings.run_id!r}"
            self._refuse(conn, Refusal.FOREIGN_RUN, detail, peer)
            return
        stale = holdings.round_refusal(node, round_)
        if stale is not None:
            self._refuse(conn, Refusal.STALE_ROUND, f"{what}: {stale}", peer)
            return
        try:
            reserved = holdings.reserve(meta.rank, meta.payload_bytes)
        except CheckpointError as err:
            self._refuse(conn, Refusal.NO_SPACE, f"{what}: {err}", peer)
            return
        if reserved is None:
            self._refuse(conn, Refusal.PROTOCOL, f"{what}: both slots are being written", peer)
            return
        slot, fd, capacity = reserved
        stripes, fill = self._stripes(request, meta.payload_bytes)
        # The final reply goes out only once the slot is released: a sender that puts its
        # next snapshot as soon as it reads the reply must find the slot free.
        reply: tuple[Refusal | None, dict[str, Any]] | None = None
        try:
            started: list[float] = []

            def go_ahead() -> None:  # the slot is mapped: the bytes may come
                send_frame(conn, {"ok": True, "stripes": stripes})
                started.append(time.perf_counter())

            trailer = recv_payload(
                conn, fd, capacity, meta.payload_bytes, ready=go_ahead, fill=fill
            )
            self._stats.received(meta.payload_bytes, time.perf_counter() - started[0])
            os.close(fd)
            fd = -1
            if trailer != COMMIT:
                reply = (None, {"ok": False, "reason": "superseded", "detail": what})
                return
            files = holdings.files(meta.rank)
            mismatch = verify_slot(files.payload_path(slot), meta)
            if mismatch is not None:
                reply = (Refusal.CHECKSUM, {"detail": f"{what}: {mismatch}"})
                return
            holdings.commit(meta.rank, slot, parsed, round_=round_, node=node)
            reply = (None, {"ok": True})
            log.debug("replica_held", rank=meta.rank, step=meta.step, node=node, slot=slot)
        finally:
            if fd >= 0:
                os.close(fd)
            holdings.release(meta.rank, slot)
            if reply is not None:
                refusal, frame = reply
                if refusal is None:
                    send_frame(conn, frame)
                else:
                    self._refuse(conn, refusal, frame["detail"], peer)

    def _stripes(self, request: dict[str, Any], nbytes: int) -> tuple[int, StripedFill | None]:
        """How many stripes a put gets (its proposal, within `MAX_STRIPES` and what its size
        warrants) and what fills them (None: all on the put's own connection)."""
        try:
            proposed = int(request.get("stripes", 1))
            session, seq = str(request.get("session", "")), int(request.get("seq", 0))
        except (TypeError, ValueError):
            return 1, None
        if proposed <= 1 or not session:
            return 1, None
        stripes = len(stripe_ranges(nbytes, min(proposed, MAX_STRIPES)))
        if stripes <= 1:
            return 1, None
        return stripes, StripedFill(self._board, session, seq, stripes, IO_TIMEOUT_S)

    def _part(self, conn: socket.socket, request: dict[str, Any]) -> None:
        """One stripe of a put on another connection ([Note: replica payloads go over
        parallel streams]); a part that fits no open put closes this connection."""
        try:
            session, seq, index = (
                str(request["session"]),
                int(request["seq"]),
                int(request["index"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ProtocolError(f"a part whose frame does not parse: {err}") from err
        self._board.receive_part(conn, session, seq, index)

    # ------------------------------------------------------------------ list / get
    def _list(self, conn: socket.socket, request: dict[str, Any]) -> None:
        holdings = self._holdings
        if str(request.get("run_id")) != holdings.run_id:
            send_frame(conn, {"ok": True, "replicas": [], "local_layouts": []})
            return
        ranks = [int(r) for r in request.get("ranks", [])]
        replicas = [
            {
                "rank": h.rank,
                "slot": h.slot,
                "step": h.meta.step,
                "round": h.raw.get("replica_round"),
            }
            for rank in ranks
            for h in holdings.held(rank)
        ]
        # [Note: group ranks move between nodes]: a rank this node ran in an earlier round is
        # served from its own slots too.
        replicas += [
            {"rank": h.rank, "slot": h.slot, "step": h.meta.step, "round": None, "local": True}
            for rank in ranks
            for h in complete_slots(SlotFiles(self._local_dir, rank), holdings.run_id)
        ]
        send_frame(
            conn,
            {
                "ok": True,
                "replicas": replicas,
                "local_layouts": _local_layouts(self._local_dir, holdings.run_id),
            },
        )

    def _get(self, conn: socket.socket, request: dict[str, Any]) -> None:
        holdings = self._holdings
        try:
            rank, slot, step = int(request["rank"]), int(request["slot"]), int(request["step"])
        except (KeyError, TypeError, ValueError) as err:
            send_frame(conn, {"ok": False, "reason": Refusal.PROTOCOL.value, "detail": str(err)})
            return
        local = request.get("local") is True
        files = SlotFiles(self._local_dir, rank) if local else holdings.files(rank)
        held_here = complete_slots(files, holdings.run_id)
        match = [h for h in held_here if h.slot == slot and h.meta.step == step]
        if str(request.get("run_id")) != holdings.run_id or not match:
            where = "snapshot" if local else "replica"
            detail = f"no {where} of rank {rank} step {step} in slot {slot}"
            send_frame(conn, {"ok": False, "reason": Refusal.PROTOCOL.value, "detail": detail})
            return
        held = match[0]
        fd = os.open(files.payload_path(slot), os.O_RDONLY | os.O_CLOEXEC)
        try:
            send_frame(conn, {"ok": True, "meta": held.raw})
            t0 = time.perf_counter()
            send_file(conn, fd, held.meta.payload_bytes)
            await_receipt(conn, held.meta.payload_bytes)
            self._stats.sent(held.meta.payload_bytes, time.perf_counter() - t0)
        finally:
            os.close(fd)
        # [Note: a sent page is read when the peer reads it] in `protocol.py`.
        unchanged = files.read_metas().get(slot) == held.raw
        conn.sendall(COMMIT if unchanged else ABORT)


def _local_layouts(directory: str, run_id: str) -> list[str]:
    """The shared-layout fingerprints of this node's own complete snapshots of `run_id`."""
    layouts = set()
    for name in os.listdir(directory):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        head = name.split(".", 1)[0].removeprefix("rank-")
        if not head.isdigit():
            continue
        raw = SlotFiles(directory, int(head)).read_metas()
        for found in raw.values():
            if isinstance(found, dict):
                with contextlib.suppress(ValueError):
                    meta = SlotMeta.parse(found)
                    if meta.run_id == run_id:
                        layouts.add(meta.global_layout)
    return sorted(layouts)
