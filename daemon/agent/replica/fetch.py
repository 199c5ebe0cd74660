"""The restore path of replicas: copy a lost node's snapshots back from the peer holding them.

Run by the daemon after a rendezvous, before its ranks start (`service.py`), for each local
rank that holds no complete snapshot of this run in the node's memory tier (a fresh daemon
that replaced a lost node; a surviving node keeps its own slots and fetches nothing). Every
other node of the round is asked what it holds of those ranks (`list`); the node with the
newest step sends all it holds of each (`get`, at most 2 slots), written into the rank's own
slot files with `posix_fallocate` first. A copy is refused (logged, counted, its slot left
empty) when its run, rank or world size is not this round's, its shared layout is none of the
peers' own snapshots' layouts, or its payload does not match its checksum; an `ABORT` trailer
(the slot changed during the send) drops it quietly. A kept copy's meta says
`origin: replica`, so the rank's restore reports `source="replica"`; the ranks' restore
agreement still decides which step every rank holds ([Note: the memory tier] in
`ckpt_manager/_memory/__init__.py`), and with no complete replica the restore falls back to
the durable tier with its reason.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import structlog

from ckpt_manager import CheckpointError
from ckpt_manager.memory_slots import ORIGIN_REPLICA, SlotFiles, SlotMeta, restamp, verify_slot
from daemon.agent.replica.holdings import complete_slots
from daemon.agent.replica.protocol import (
    COMMIT,
    ProtocolError,
    Refusal,
    configure,
    recv_frame,
    recv_payload,
    send_frame,
)
from daemon.agent.replica.sender import parse_address
from daemon.agent.replica.stats import ReplicaStats

__all__ = ["Fetched", "fetch_missing", "former_ranks", "missing_ranks"]

log = structlog.get_logger("trainingd.replica")


class Fetched(NamedTuple):
    """What a fetch brought back."""

    steps: dict[int, list[int]]
    """Steps copied into local slots, by rank."""
    reasons: dict[int, str]
    """Why a rank got nothing, by rank."""


def missing_ranks(tier_dir: str, run_id: str, ranks: Sequence[int]) -> list[int]:
    """The ranks of `ranks` with no complete snapshot of `run_id` in `tier_dir`."""
    missing = []
    for rank in ranks:
        held = False
        for raw in SlotFiles(tier_dir, rank).read_metas().values():
            if isinstance(raw, dict):
                with contextlib.suppress(ValueError):
                    held = held or SlotMeta.parse(raw).run_id == run_id
        if not held:
            missing.append(rank)
    return missing


def former_ranks(tier_dir: str, ranks: Sequence[int]) -> list[int]:
    """Ranks with slot files in `tier_dir` that are not this node's in the round (`ranks`):
    ranks it ran in an earlier round ([Note: group ranks move between nodes])."""
    return sorted(set(SlotFiles.ranks_in(tier_dir)) - set(ranks))


def fetch_missing(
    tier_dir: str,
    *,
    run_id: str,
    ranks: Sequence[int],
    world_size: int,
    peers: Mapping[int, str],
    stats: ReplicaStats,
    timeout_s: float,
    own_replicas: str | None = None,
) -> Fetched:
    """Copy `ranks`' newest snapshots into `tier_dir`'s slots, from wherever they are held.

    Args:
        tier_dir: this node's memory-tier directory.
        run_id: this run.
        ranks: the local ranks to fetch (`missing_ranks`).
        world_size: ranks in this round (a replica of another world size is refused).
        peers: the other nodes' replica servers, `host:port` by group rank.
        stats: the counters.
        timeout_s: socket timeout of each request.
        own_replicas: this node's `replicas/` directory ([Note: group ranks move between
            nodes]: a rank this node held replicas of may now be one of its own).
    """
    listings: dict[int, dict[str, Any]] = {}
    for node, address in sorted(peers.items()):
        try:
            with _connect(address, timeout_s) as sock:
                send_frame(sock, {"op": "list", "run_id": run_id, "ranks": list(ranks)})
                reply = recv_frame(sock)
        except (OSError, ProtocolError) as err:
            stats.failed(Refusal.CONNECTION, "replica_list_failed", peer=address, error=str(err))
            continue
        if reply is not None and reply.get("ok") is True:
            listings[node] = reply
    layouts = {str(lay) for reply in listings.values() for lay in reply.get("local_layouts", [])}
    steps: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for rank in ranks:
        # Each offer's source: (peer node, its own slot?) or (None, False) for this node's own
        # replicas. The copies come from one source, so two slots never mix two timelines.
        offers: list[tuple[int, tuple[int | None, bool], Mapping[str, Any]]] = [
            (int(entry["step"]), (node, entry.get("local") is True), entry)
            for node, reply in listings.items()
            for entry in reply.get("replicas", [])
            if int(entry.get("rank", -1)) == rank
        ]
        if own_replicas is not None:
            offers += [
                (h.meta.step, (None, False), {"step": h.meta.step, "slot": h.slot, "raw": h.raw})
                for h in complete_slots(SlotFiles(own_replicas, rank), run_id)
            ]
        if not offers:
            reasons[rank] = f"no peer holds a complete replica of rank {rank}"
            continue
        best = max(offers, key=lambda o: o[0])[1]
        mine = sorted((o for o in offers if o[1] == best), key=lambda o: o[0])
        files = SlotFiles(tier_dir, rank)
        expect = _Expect(run_id, rank, world_size, layouts)
        for local_slot, (step, (peer, _), entry) in enumerate(mine[-2:]):
            if peer is None:
                source = SlotFiles(str(own_replicas), rank)
                why = _adopt_one(source, files, local_slot, entry, expect, stats)
            else:
                why = _fetch_one(peers[peer], files, local_slot, entry, expect, stats, timeout_s)
            if why is None:
                steps.setdefault(rank, []).append(step)
            else:
                reasons[rank] = why
        if rank in steps:
            reasons.pop(rank, None)
    return Fetched(steps, reasons)


def _adopt_one(
    source: SlotFiles,
    files: SlotFiles,
    slot: int,
    entry: Mapping[str, Any],
    expect: _Expect,
    stats: ReplicaStats,
) -> str | None:
    """Copy one of this node's own replicas into the rank's `slot`; None, or why not."""
    raw = dict(entry["raw"])
    meta = SlotMeta.parse(raw)
    what = f"this node's replica of rank {expect.rank} step {meta.step}"
    refused = expect.refusal(meta)
    if refused is not None:
        stats.failed(refused[0], "replica_fetch_refused", replica=what, detail=refused[1])
        return f"{what}: {refused[1]}"
    files.remove_meta(slot)
    try:
        fd, _ = files.allocate(slot, meta.payload_bytes)
        try:
            with open(source.payload_path(int(entry["slot"])), "rb") as src:
                copied = 0
                while copied < meta.payload_bytes:
                    n = os.sendfile(fd, src.fileno(), copied, meta.payload_bytes - copied)
                    if n == 0:
                        raise OSError(f"{source.payload_path(int(entry['slot']))}: short file")
                    copied += n
        finally:
            os.close(fd)
    except (CheckpointError, OSError) as err:
        stats.failed(Refusal.NO_SPACE, "replica_fetch_failed", replica=what, detail=str(err))
        return f"{what}: {err}"
    mismatch = verify_slot(files.payload_path(slot), meta)
    if mismatch is not None:  # the replica changed while it was copied, or is damaged
        stats.failed(Refusal.CHECKSUM, "replica_fetch_refused", replica=what, detail=mismatch)
        return f"{what}: {mismatch}"
    files.write_meta(slot, restamp(raw, origin=ORIGIN_REPLICA))
    return None


class _Expect(NamedTuple):
    run_id: str
    rank: int
    world_size: int
    layouts: set[str]

    def refusal(self, meta: SlotMeta) -> tuple[Refusal, str] | None:
        if meta.run_id != self.run_id:
            return Refusal.FOREIGN_RUN, f"run {meta.run_id!r}, not {self.run_id!r}"
        if meta.rank != self.rank:
            return Refusal.MISMATCH, f"rank {meta.rank}, not {self.rank}"
        if meta.world_size != self.world_size:
            return Refusal.MISMATCH, f"world size {meta.world_size}, {self.world_size} now"
        if self.layouts and meta.global_layout not in self.layouts:
            return Refusal.MISMATCH, "its layout is none of the peers' own snapshots' layouts"
        return None


def _connect(address: str, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=timeout_s)
    configure(sock, timeout_s)
    return sock


def _fetch_one(
    address: str,
    files: SlotFiles,
    slot: int,
    entry: Mapping[str, Any],
    expect: _Expect,
    stats: ReplicaStats,
    timeout_s: float,
) -> str | None:
    """Copy one replica into `slot`; None, or why not (logged and counted)."""
    rank, step = expect.rank, int(entry["step"])
    what = f"replica of rank {rank} step {step} from {address}"
    files.remove_meta(slot)
    try:
        with _connect(address, timeout_s) as sock:
            request = {"op": "get", "run_id": expect.run_id, "rank": rank, "step": step}
            send_frame(sock, {**request, "slot": int(entry["slot"]), "local": entry.get("local")})
            reply = recv_frame(sock)
            if reply is None or reply.get("ok") is not True:
                detail = None if reply is None else reply.get("detail")
                stats.failed(Refusal.PROTOCOL, "replica_fetch_failed", replica=what, detail=detail)
                return f"{what}: the peer did not send it ({detail})"
            raw = reply["meta"]
            try:
                meta = SlotMeta.parse(raw)
            except ValueError as err:
                stats.failed(
                    Refusal.CHECKSUM, "replica_fetch_refused", replica=what, detail=str(err)
                )
                return f"{what}: {err}"
            refused = expect.refusal(meta)
            if refused is not None:
                # Refused before any byte lands; the connection is dropped with the payload.
                stats.failed(refused[0], "replica_fetch_refused", replica=what, detail=refused[1])
                return f"{what}: {refused[1]}"
            fd, capacity = files.allocate(slot, meta.payload_bytes)
            try:
                t0 = time.perf_counter()
                trailer = recv_payload(sock, fd, capacity, meta.payload_bytes)
                stats.received(meta.payload_bytes, time.perf_counter() - t0)
            finally:
                os.close(fd)
    except CheckpointError as err:
        stats.failed(Refusal.NO_SPACE, "replica_fetch_failed", replica=what, detail=str(err))
        return f"{what}: {err}"
    except (OSError, ProtocolError, KeyError, TypeError, ValueError) as err:
        stats.failed(Refusal.CONNECTION, "replica_fetch_failed", replica=what, detail=str(err))
        return f"{what}: {type(err).__name__}: {err}"
    if trailer != COMMIT:
        return f"{what}: its slot changed while it was sent"
    mismatch = verify_slot(files.payload_path(slot), meta)
    if mismatch is not None:
        stats.failed(Refusal.CHECKSUM, "replica_fetch_refused", replica=what, detail=mismatch)
        return f"{what}: {mismatch}"
    files.write_meta(slot, restamp(raw, origin=ORIGIN_REPLICA))
    return None
