"""The checkpoint root's start-up checks of a node of a multi-node job, in its first round.

[Note: a node joining a running job skips the root checks] A single-node daemon checks its
checkpoint root before anything else (`preflight.py`: the root is writable, and no other live
run holds its lease; exit 2 with one line otherwise). A node of a multi-node job checks it
after its first rendezvous instead, once it knows the job's membership round (counted in the
rendezvous store, `replica/peers.py`):
  - round 1, the job's first: the same checks, on every node, and the same exit 2 with the same
    line when one fails (`StartupCheckError`, raised before this node's ranks start);
  - a later round: this node is joining a job that already trained (a fresh daemon replacing a
    lost node, a node returning to an elastic job). The job's coordinator holds the root's
    lease and fences it ([Note: fencing] in `ckpt_manager/_store/lease.py`), so the checks
    would only read the lease and probe the store on the recovery's critical path: a node
    replaced from its peer's replica then reads nothing from the root before its ranks train
    (issue 29, `node_loss_storage_bytes_read`). Logged as `root_checks_skipped`;
  - the round unknown (a round of one node exchanges nothing, or the exchange failed): the
    checks run, as in round 1.
Only this daemon's first round decides; its later rounds are rounds of a job it is in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from daemon.agent.elastic import RoundHook
from daemon.agent.preflight import check_root_access
from daemon.config import DaemonConfig

__all__ = ["FirstRoundRootChecks"]

log = structlog.get_logger("trainingd.agent")


class FirstRoundRootChecks:
    """A round hook: the inner hook (which learns the round), then, on this daemon's first
    round, the root's checks unless the job already ran a round
    ([Note: a node joining a running job skips the root checks]).

    Args:
        cfg: the daemon's configuration.
        inner: the node's own round hook (the replica ring's exchange), which returns the
            job's membership round.
    """

    def __init__(self, cfg: DaemonConfig, inner: RoundHook) -> None:
        self._cfg = cfg
        self._inner = inner
        self._decided = False

    def __call__(
        self, store: Any, group_rank: int, num_nodes: int, ranks: Sequence[int], world_size: int
    ) -> int | None:
        """Run the inner hook, then the checks when due.

        Raises:
            StartupCheckError: a check failed (this node's ranks do not start).
        """
        round_ = self._inner(store, group_rank, num_nodes, list(ranks), world_size)
        if not self._decided:
            self._decided = True
            if round_ is not None and round_ > 1:
                log.info(
                    "root_checks_skipped",
                    round=round_,
                    reason="joining a job that already ran a round: its coordinator holds "
                    "the checkpoint root's lease",
                )
            else:
                check_root_access(self._cfg)
                log.debug("root_checks_passed", round=round_)
        return round_
