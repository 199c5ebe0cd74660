"""Peers of a membership round: the round's number and every node's replica address.

Exchanged through the rendezvous's own c10d store (hosted by node 0's daemon for the whole
job), under keys of our own, right after each rendezvous and before the ranks start:

    <round store>  trainingd.replica.round          the round number, set by group rank 0
    <round store>  trainingd.replica.addr.<g>       `host:port` of group rank g's server
                                                    (empty: that node keeps no replicas)
    <base store>   trainingd.replica.<run>.rounds   a counter, one increment per round

`<round store>` is the store the rendezvous hands the agent, prefixed by torch with the
rendezvous round, so the keys of an earlier round (a dead node's address) are never read;
`<base store>` is the store under that prefix, shared by every round.

[Note: the membership round of a replica] A replica is stamped with the round it was sent in:
the number of rendezvous rounds this job has completed, counted in the base store by each
round's group rank 0 and read by every node of the round, so all nodes of a round agree on it
and it only grows, whoever joins (a replacement node starts at the job's current round, not
at 1). A receiver refuses a replica from a round older than the newest it accepted from that
sender: a replaced node that still streams (partitioned, not dead) cannot overwrite the
replicas its replacement sends.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

__all__ = ["RoundPeers", "exchange"]

_PREFIX = "trainingd.replica"


class RoundPeers(NamedTuple):
    """What a node learns after a rendezvous."""

    round: int
    """The membership round ([Note: the membership round of a replica])."""
    addresses: dict[int, str]
    """`host:port` of every node's replica server, by group rank."""


def exchange(
    store: Any, *, run_id: str, group_rank: int, num_nodes: int, address: str, timeout_s: float
) -> RoundPeers:
    """Publish this node's address, agree on the round, read every node's address.

    Args:
        store: the round's rendezvous store (`WorkerGroup.store`: a `PrefixStore`).
        run_id: the run (names the base store's counter).
        group_rank: this node's rank in the round.
        num_nodes: nodes in the round.
        address: this node's replica server, `host:port`.
        timeout_s: how long to wait for the other nodes' keys.

    Raises:
        RuntimeError: a key did not appear in time or the store is gone (torch's
            `DistStoreError` and the like, all `RuntimeError`s).
    """
    key = f"{_PREFIX}.round"
    if group_rank == 0:
        counter = store.underlying_store.add(f"{_PREFIX}.{run_id}.rounds", 1)
        store.set(key, str(counter))
    store.set(f"{_PREFIX}.addr.{group_rank}", address)
    keys = [key, *(f"{_PREFIX}.addr.{g}" for g in range(num_nodes))]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    round_ = int(store.get(key).decode())
    addresses = {g: store.get(f"{_PREFIX}.addr.{g}").decode() for g in range(num_nodes)}
    return RoundPeers(round_, addresses)
