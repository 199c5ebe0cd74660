"""The replicas a node holds for its peers: `<tier dir>/replicas/`, two slots per remote rank.

    replicas/rank-<r:05d>.slot-<k>        payload, as the rank's own slot file
    replicas/rank-<r:05d>.slot-<k>.json   meta: the rank's meta, restamped with
                                          `replica_round` and `replica_node` (the sender)

The same rule as a rank's own slots ([Note: which slot a snapshot takes] in
`ckpt_manager/_memory/tier.py`): an arriving replica never goes to the slot of the newest
complete one, nor to a slot another transfer is writing; of the two slots it takes an empty
one, else the older. Its meta is removed before the first byte lands and written only once the
payload verified, so a transfer that breaks leaves that slot empty and the newest intact.
Payloads are allocated with `posix_fallocate` first: a full tmpfs is a refusal, never a SIGBUS.

The membership round of every sender (its node rank) is remembered: a replica from a round
older than the newest accepted from that node is refused (a replaced node that still streams).

Every commit also names, in the tier's `kept-step.json`, the newest step that every rank
replicated here in that round holds complete: this node's own ranks keep their snapshot of it
([Note: a node keeps the step its peer's replica holds] in `ckpt_manager/_memory/keep.py`), so
after a loss of the sending node its ranks' replicas and this node's slots share a step.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from ckpt_manager.memory_slots import (
    MetaReader,
    ParsedMeta,
    SlotFiles,
    SlotMeta,
    stamp,
    write_kept_step,
)

__all__ = ["NUM_REPLICA_SLOTS", "HeldReplica", "ReplicaHoldings", "complete_slots"]

NUM_REPLICA_SLOTS = 2
"""Slots per remote rank."""

_log = structlog.get_logger("trainingd.replica")


class HeldReplica(NamedTuple):
    """A complete replica held here."""

    rank: int
    """The rank whose snapshot it is."""
    slot: int
    """Its slot under `replicas/`."""
    meta: SlotMeta
    """Its parsed meta."""
    raw: dict[str, Any]
    """Its meta as written (restamped)."""


class ReplicaHoldings:
    """The `replicas/` directory of one node's memory tier.

    Args:
        directory: `<tier dir>/replicas` (created here).
        run_id: this run (a replica of another is never held).
    """

    def __init__(self, directory: Path, run_id: str) -> None:
        directory.mkdir(mode=0o700, exist_ok=True)
        self.directory = directory
        """The replicas' directory."""
        self.run_id = run_id
        """This run."""
        self._lock = threading.Lock()
        self._busy: set[tuple[int, int]] = set()
        self._rounds: dict[int, int] = {}
        # Per remote rank, the round and step of its newest committed replica; the step
        # written to `kept-step.json` last.
        self._newest: dict[int, tuple[int, int]] = {}
        self._kept: int | None = None
        self._metas = MetaReader()

    def files(self, rank: int) -> SlotFiles:
        """`rank`'s slot files under `replicas/`."""
        return SlotFiles(str(self.directory), rank)

    def round_refusal(self, node: int, round_: int) -> str | None:
        """Why a replica of round `round_` from node `node` is stale (None: it is not)."""
        with self._lock:
            newest = self._rounds.get(node)
        if newest is not None and round_ < newest:
            return f"round {round_} from node {node}, older than its round {newest} accepted"
        return None

    def held(self, rank: int) -> list[HeldReplica]:
        """`rank`'s complete replicas of this run (their metas parse), oldest step first."""
        return complete_slots(self.files(rank), self.run_id, self._metas)

    def reserve(self, rank: int, nbytes: int) -> tuple[int, int, int] | None:
        """Empty and allocate the slot an arriving replica of `rank` takes.

        Returns:
            `(slot, fd, capacity)` (the caller owns `fd` and calls `release(rank, slot)`), or
            None when both slots are being written by other transfers.

        Raises:
            CheckpointError: the tmpfs has no room (`SlotFiles.allocate`).
        """
        files = self.files(rank)
        with self._lock:
            held = {h.slot: h.meta.step for h in self.held(rank)}
            newest = max(held, key=lambda k: held[k]) if held else None
            free = [
                k for k in range(NUM_REPLICA_SLOTS) if k != newest and (rank, k) not in self._busy
            ]
            if not free:
                return None
            slot = min(free, key=lambda k: (k in held, held.get(k, -1), k))
            self._busy.add((rank, slot))
        try:
            files.remove_meta(slot)
            fd, capacity = files.allocate(slot, nbytes)
        except BaseException:
            self.release(rank, slot)
            raise
        return slot, fd, capacity

    def release(self, rank: int, slot: int) -> None:
        """The transfer into `slot` is over (committed or not)."""
        with self._lock:
            self._busy.discard((rank, slot))

    def commit(self, rank: int, slot: int, parsed: ParsedMeta, *, round_: int, node: int) -> None:
        """The payload in `slot` verified against `parsed` (the sender's meta, checked): write
        it stamped; remember the round.

        Raises:
            CheckpointError: the meta could not be written.
        """
        files = self.files(rank)
        stamped = stamp(parsed, replica_round=round_, replica_node=node)
        files.write_meta(slot, stamped.data)
        self._metas.remember(files, slot, stamped)
        with self._lock:
            self._rounds[node] = max(round_, self._rounds.get(node, round_))
            self._newest[rank] = (round_, parsed.meta.step)
            kept = min(step for r, step in self._newest.values() if r == round_)
            if kept == self._kept:
                return
            self._kept = kept
            try:
                write_kept_step(str(self.directory.parent), self.run_id, kept)
            except OSError as err:  # costs the guarantee of a shared step, never the replica
                _log.warning("replica_kept_step_failed", step=kept, error=str(err))


def complete_slots(
    files: SlotFiles, run_id: str, metas: MetaReader | None = None
) -> list[HeldReplica]:
    """The complete snapshots of `run_id` in `files` (their metas parse and name that rank),
    oldest step first: replicas under `replicas/`, or a rank's own slots.

    Args:
        files: the slot files.
        run_id: the run.
        metas: the reader that keeps their parses (None: all read afresh).
    """
    found = [
        HeldReplica(files.rank, slot, parsed.meta, parsed.raw)
        for slot, parsed in (metas or MetaReader()).complete(files).items()
        if parsed.meta.run_id == run_id and parsed.meta.rank == files.rank
    ]
    return sorted(found, key=lambda h: h.meta.step)
