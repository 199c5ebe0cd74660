"""Peer replicas of the memory tier: each node's snapshots, held by the next node's daemon.

Module plan:
    protocol.py   the wire format: JSON frames, raw payloads (`sendfile` out, `recv_into` a
                  mapped slot file in), a commit/abort trailer; the refusal reasons.
    holdings.py   the replicas this node holds (`<tier dir>/replicas/`, 2 slots per remote
                  rank, the newest never overwritten) and each sender's newest round.
    server.py     receive (`put`: refuse foreign runs, stale rounds, a full tmpfs; verify,
                  then write the meta) and serve (`list`, `get`) for a fetching node.
    sender.py     stream every complete snapshot of the local ranks to the next node, off the
                  training thread; a newer snapshot supersedes an unsent older one.
    watch.py      `NewFiles`: wakes the sender when a meta is renamed into the tier's
                  directory (inotify through libc; polls without it).
    stripes.py    a payload of 8 MiB or more striped over the sender's
                  `memory_replica_streams` connections (`part` frames), both ends in threads.
    fetch.py      after a node loss: copy a lost node's snapshots back from the peer holding
                  them, before the ranks start (`source="replica"` on their restore).
    peers.py      the round number and every node's address, through the rendezvous store.
    stats.py      bytes, seconds, failures by reason, lag in steps (the daemon's metrics).
    service.py    `ReplicaService`: all of the above, driven by the agent's rounds.

[Note: the replica ring] With N >= 2 nodes in a membership round, the node of group rank g
streams to the node of group rank (g + 1) % N; the ring is rebuilt after every rendezvous
(`service.py`). Replicas are stamped with the run id, the round ([Note: the membership round
of a replica] in `peers.py`), and the rank's own meta (step, global rank, world size, layouts,
checksum).

[Note: group ranks move between nodes] torch's c10d rendezvous numbers the nodes of a round
by (host name, agent pid), not by `--node-rank`: a fresh daemon that replaced a lost node can
take the group rank (so the global ranks) the survivor had, and the survivor the lost node's.
So a rank's snapshot is looked for wherever it is: a node missing rank r's slots takes them
from its own `replicas/` (`fetch.py`, copied into its slots) or from a peer, which serves
both its replicas and its own slots of ranks it ran in an earlier round (`server.py`). Those
former slots are dropped once a rank of the new round snapshotted (`sender.py`), which is
after every rank's restore agreement, so after every peer fetched them. Node 0 hosts the
rendezvous store, so node 0's loss ends the job as before
(README "Recovery").
"""

from daemon.agent.replica.service import ReplicaService, announce_without_replicas

__all__ = ["ReplicaService", "announce_without_replicas"]
