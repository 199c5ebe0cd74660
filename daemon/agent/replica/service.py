"""`ReplicaService`: the daemon's replica server, sender and fetch, wired to the rounds.

Started with the daemon when the memory tier is on and `DaemonConfig.num_memory_replicas` is
1; closed before the memory tier's directory is removed. After every rendezvous, before the
round's ranks start, the elastic agent calls `on_rendezvous` (`daemon/agent/elastic.py`):

    peers.exchange   the round number, every node's replica address (rendezvous store)
    fetch            local ranks without a complete snapshot: copy theirs back from a peer
    sender.set_ring  from now on stream to group rank (g + 1) % N

A failure of any of these is logged and costs only the replicas (the ranks then restore as
without them); it never fails the round.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from daemon.agent.memory_dir import REPLICAS_DIR
from daemon.agent.replica.fetch import fetch_missing, former_ranks, missing_ranks
from daemon.agent.replica.holdings import ReplicaHoldings
from daemon.agent.replica.peers import exchange
from daemon.agent.replica.sender import ReplicaSender, Ring
from daemon.agent.replica.server import IO_TIMEOUT_S, ReplicaServer
from daemon.agent.replica.stats import ReplicaStats
from daemon.config import DaemonConfig
from daemon.errors import StartupCheckError

__all__ = ["ReplicaService", "announce_without_replicas", "replica_bind_address"]

log = structlog.get_logger("trainingd.replica")

_PEERS_TIMEOUT_S = 60.0
"""How long a node waits for the other nodes' replica addresses after a rendezvous."""
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def replica_bind_address(configured: str, rdzv_endpoint: str) -> tuple[str, int]:
    """Where the replica server binds: `memory_replica_address` (`host[:port]`, port 0 or
    none: a free one), by default the host this node is known by in the rendezvous
    (loopback when the rendezvous is on loopback, else this host's fully qualified name).

    Raises:
        ValueError: a port that is not a number in 0..65535.
    """
    host, port = configured, "0"
    if configured.count(":") == 1 or configured.startswith("["):
        host, _, port = configured.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"memory_replica_address={configured!r}: use host[:port] with a port in 0..65535"
        )
    host = host.strip("[]")
    if not host:
        loopback = rdzv_endpoint.rsplit(":", 1)[0] in _LOOPBACK
        host = "127.0.0.1" if loopback else socket.getfqdn()
    return host, int(port)


class ReplicaService:
    """This node's part of the replica ring (see the module docstring).

    Args:
        cfg: the effective configuration.
        tier_dir: this node's memory-tier directory (claimed).
        rdzv_endpoint: the rendezvous endpoint (the default bind host follows it).

    Raises:
        StartupCheckError: the replica address cannot be bound (exit 2).
    """

    def __init__(self, cfg: DaemonConfig, tier_dir: Path, rdzv_endpoint: str) -> None:
        self._cfg = cfg
        self._tier_dir = str(tier_dir)
        self.stats = ReplicaStats()
        """The counters (`values()` feeds the collector)."""
        address = cfg.checkpoint.memory_replica_address
        try:
            host, port = replica_bind_address(address, rdzv_endpoint)
            holdings = ReplicaHoldings(tier_dir / REPLICAS_DIR, cfg.run_id)
            self._server = ReplicaServer(holdings, self._tier_dir, self.stats, host, port)
        except (OSError, ValueError) as err:
            raise StartupCheckError(
                f"memory_replica_address={address!r}: cannot bind the replica server ({err}); "
                "give a local host[:port] this node is reachable at, port 0 for a free one"
            ) from None
        advertised = socket.getfqdn() if host in ("0.0.0.0", "::") else host
        self.address = (
            f"[{advertised}]:{self._server.port}"
            if ":" in advertised
            else (f"{advertised}:{self._server.port}")
        )
        """`host:port` the other nodes reach this node's server at."""
        self._sender = ReplicaSender(
            self._tier_dir,
            cfg.run_id,
            cfg.launch.node_rank,
            self.stats,
            streams=cfg.checkpoint.memory_replica_streams,
        )
        log.info("replica_server_started", address=self.address, replicas=1)

    def values(self) -> Mapping[str, Mapping[str, float]]:
        """The `trainingd_memory_replica_*` families' values now."""
        return self.stats.values()

    def on_rendezvous(
        self, store: Any, group_rank: int, num_nodes: int, ranks: Sequence[int], world_size: int
    ) -> int | None:
        """A round formed and its ranks are about to start (see the module docstring).

        Args:
            store: the round's rendezvous store.
            group_rank: this node's rank in the round.
            num_nodes: nodes in the round.
            ranks: this node's global ranks in the round.
            world_size: ranks in the round.

        Returns:
            The job's membership round, or None when this node could not learn it (a round of
            one node exchanges nothing; a failed exchange).
        """
        if num_nodes < 2:
            self._sender.set_ring(Ring(0, None, tuple(ranks)))
            return None
        try:
            peers = exchange(
                store,
                run_id=self._cfg.run_id,
                group_rank=group_rank,
                num_nodes=num_nodes,
                address=self.address,
                timeout_s=_PEERS_TIMEOUT_S,
            )
        except (RuntimeError, ValueError) as err:
            self._sender.set_ring(Ring(0, None, tuple(ranks)))
            log.warning(
                "replica_ring_unavailable",
                error=f"{type(err).__name__}: {err}",
                note="no replica is sent or fetched this round",
            )
            return None
        # "": that node keeps no replicas (its memory tier or replicas are off).
        others = {g: a for g, a in peers.addresses.items() if g != group_rank and a}
        try:
            self._fetch(peers.round, others, ranks, world_size)
        except Exception as err:  # a failed fetch costs the replicas, never the round
            log.warning("replica_fetch_failed", error=f"{type(err).__name__}: {err}")
        target = peers.addresses[(group_rank + 1) % num_nodes] or None
        former = former_ranks(self._tier_dir, ranks)
        self._sender.set_ring(Ring(peers.round, target, tuple(ranks)), former=former)
        log.info("replica_ring", round=peers.round, group_rank=group_rank, target=target)
        return peers.round

    def _fetch(
        self, round_: int, others: dict[int, str], ranks: Sequence[int], world_size: int
    ) -> None:
        """Copy back the snapshots of local ranks that hold none (`fetch.py`)."""
        missing = missing_ranks(self._tier_dir, self._cfg.run_id, ranks)
        if missing:
            fetched = fetch_missing(
                self._tier_dir,
                run_id=self._cfg.run_id,
                ranks=missing,
                world_size=world_size,
                peers=others,
                stats=self.stats,
                timeout_s=IO_TIMEOUT_S,
                own_replicas=os.path.join(self._tier_dir, REPLICAS_DIR),
            )
            log.info(
                "replica_fetched",
                round=round_,
                ranks=missing,
                steps={str(r): s for r, s in fetched.steps.items()},
                reasons={str(r): why for r, why in fetched.reasons.items()},
            )

    def close(self) -> None:
        """Stop sending and serving (before the tier's directory goes)."""
        self._sender.close()
        self._server.close()


def announce_without_replicas(
    run_id: str,
) -> Callable[[Any, int, int, Sequence[int], int], int | None]:
    """The round hook of a node of a multi-node job that keeps no replicas (its memory tier or
    its replicas are off, e.g. `auto` found no room): it takes part in the exchange with an
    empty address, so the other nodes neither wait for it nor stream to it, and, as group
    rank 0, still counts the round. Returns the job's membership round, as `on_rendezvous`."""

    def hook(
        store: Any, group_rank: int, num_nodes: int, ranks: Sequence[int], _w: int
    ) -> int | None:
        if num_nodes < 2:
            return None
        try:
            peers = exchange(
                store,
                run_id=run_id,
                group_rank=group_rank,
                num_nodes=num_nodes,
                address="",
                timeout_s=_PEERS_TIMEOUT_S,
            )
        except (RuntimeError, ValueError) as err:
            log.warning("replica_ring_unavailable", error=f"{type(err).__name__}: {err}")
            return None
        return peers.round

    return hook
