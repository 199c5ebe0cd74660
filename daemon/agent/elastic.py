"""The rank group under torch's elastic agent, in membership rounds.

torch's `elastic_launch` runs one agent and closes the rendezvous when it returns, for every
node. That fits a fixed `--nnodes N`: a stopped node ends the run everywhere, and the other nodes
exit 75 so that their supervisor restarts them into the next rendezvous. An elastic job
(`--nnodes MIN:MAX`, MIN < MAX) must go on instead, so this module keeps one rendezvous handler
for the daemon's whole life and runs one `LocalElasticAgent` per *membership round*:

    round: rendezvous (>= MIN nodes, last call for more) -> ranks restore the newest committed
    checkpoint (resharded to this world size) and train -> the round ends when the ranks return

[Note: membership changes end a round gracefully]
A round whose ranks return *stopped* without a signal on this node ended for a membership
change, and the next round starts at once:
- shrink: a peer was stopped (SIGTERM: every rank agreed on the step and committed a final
  checkpoint). The peer leaves the rendezvous open (it closes it only when the job is done), its
  heartbeats stop, and the rendezvous (c10d or etcd-v2) drops it after `keep_alive_interval x
  keep_alive_max_attempt` (`_KEEP_ALIVE_S` x `_KEEP_ALIVE_ATTEMPTS`); the remaining nodes form
  the next round once MIN are present and `rdzv_last_call_s` has passed. A peer that *died*
  (SIGKILL) makes the ranks here fail in their next collective; the agent restarts them into a
  new rendezvous within its `max_restarts` budget, as for any failure, from the last periodic
  checkpoint.
- grow: a node that arrives while a round runs waits in the rendezvous's wait list. torch's
  agent would see it (`num_nodes_waiting() > 0`) and kill the ranks mid-step, losing every step
  since the last checkpoint. `MembershipWatch` answers 0 to the agent instead and writes the stop
  request the ranks poll: they agree on the next step, commit a checkpoint there and return, and
  the next round takes the waiting node in.
A round that reaches `max_steps` closes the rendezvous (so waiting nodes learn the job is done);
a node stopped by a signal leaves it open for the others.

Every round's agent starts its ranks the same way: forked from the daemon's fork server, which
this launcher starts once, before the first round, and stops when it returns (`fork_server.py`;
`rank_start = "spawn"`, or a server found unsafe to fork, spawns them instead).

After every rendezvous and before the round's ranks start (a restart within a round is a new
rendezvous too), `on_rendezvous` is called with the round's store and this node's place in it:
the daemon's peer replicas publish their address there and copy a lost node's snapshots back
(`daemon/agent/replica/`).

The restart budget spans the daemon's life: each round's agent gets what the earlier rounds left
of `max_restarts`, and ranks number their incarnations across rounds (`restart_offset`), so the
restarts gauge counts failures only, never membership changes.

Each failed attempt is handed to `on_failure` (the daemon's `FailureTracker.record`,
`failures.py`) before the agent decides to restart: it records the failures and may end the
retries at once (a deterministic failure, or the job's own before training), as a spent
budget would.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from daemon.agent import rdzv_poll
from daemon.agent.failures import RankExit
from daemon.agent.fork_server import START_METHOD, ForkServer, preload_modules, warm_entry
from daemon.agent.rdzv_delegate import DelegatingHandler
from daemon.agent.relay import RankOutputRelay, RelayLogsSpecs
from daemon.agent.store_guard import StoreGuard
from daemon.config import DaemonConfig, RankStart, RdzvBackend
from daemon.errors import ForkServerError
from daemon.observe.incidents import IncidentLog
from daemon.rundir.control import clear_stop

__all__ = [
    "ElasticLauncher",
    "FailureHook",
    "LaunchOutcome",
    "MembershipWatch",
    "RoundHook",
    "WaitListThrottle",
]

log = structlog.get_logger("trainingd.elastic")

_KEEP_ALIVE_S = 2
"""Rendezvous heartbeat interval of each node (torch's default is 5 s)."""
_KEEP_ALIVE_ATTEMPTS = 3
"""Missed heartbeats after which the rendezvous drops a node: a node gone without a word is
noticed after about 6 s (torch's default: 15 s)."""
_MONITOR_INTERVAL_S = 0.05
"""How often the agent checks its ranks: a dead rank is seen 25 ms after its death on average
(it was 0.2 s: 0.1 s of every rank-kill recovery, [Note: the recovery timeline] in
`bench/recovery_timeline.py`). A check is a non-blocking poll of the rank processes."""
_WAIT_LIST_EVERY_S = 0.2
"""How often the rendezvous's wait list is asked for (a store read, on node 0's store for every
node), whatever the monitor interval: `WaitListThrottle`."""
_AGENT_SHUTDOWN_S = 10
"""SIGTERM-to-SIGKILL grace the agent gives ranks it stops."""
_FORK_SERVER_START_S = 300.0
"""How long the fork server's imports may take (seconds unloaded; a loaded node is slower, and
a spawned rank would pay the same)."""


def agent_shutdown_kwargs(agent_class: type) -> dict[str, Any]:
    """`shutdown_timeout` for agents that take it (torch >= 2.12); older agents (the range in
    pyproject starts at 2.6) give ranks their own fixed 30 s between SIGTERM and SIGKILL, and
    refuse the argument."""
    if "shutdown_timeout" in inspect.signature(agent_class).parameters:
        return {"shutdown_timeout": _AGENT_SHUTDOWN_S}
    return {}


RoundHook = Callable[[Any, int, int, list[int], int], int | None]
"""Called after each rendezvous, before the ranks start, as
`hook(store, group_rank, num_nodes, global_ranks, world_size)`: the round's rendezvous store,
this node's rank among the round's nodes, their number, this node's global ranks and the world
size (`ReplicaService.on_rendezvous`); it returns the job's membership round when it learnt it
(None otherwise). An exception from it ends the launch (a `StartupCheckError` from the root
checks of a node's first round: `root_checks.py`)."""

FailureHook = Callable[[list[RankExit], int], bool]
"""Called with the failed ranks of an attempt and its restart count (membership rounds
included); returns whether the group may be restarted (`FailureTracker.record` allows it
unless the verdict says the failure is not worth a retry)."""

Entry = Callable[..., dict[str, Any] | None]
"""A rank entry point: `entry(cfg, run_dir, daemon_pid, restart_offset, relayed)` -> its summary
(`daemon.worker.elastic_entry`; torch's `@record` types its result as optional)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class LaunchOutcome:
    """How this node's rank groups ended."""

    rounds: list[list[dict[str, Any]]]
    """Every membership round's rank results (local rank order), oldest first."""
    rendezvous_error: str | None = None
    """Set when a later round could not form (host gone, fewer than MIN nodes, job closed)."""

    @property
    def last(self) -> list[dict[str, Any]]:
        """The last round's rank results (empty if none returned)."""
        return self.rounds[-1] if self.rounds else []

    def summary_results(self) -> list[dict[str, Any]]:
        """The last round's rank results, counted from the first round's start.

        The run's summary speaks of the whole run: steps from where the first round restored,
        tokens of every round; how it ended (final step, loss, stopped) is the last round's.
        """
        last = [dict(r) for r in self.last]
        if not last or len(self.rounds) < 2:
            return last
        start = min((int(r.get("start_step", 0)) for r in self.rounds[0]), default=0)
        for r in last:
            r["start_step"] = start
        earlier = sum(int(r.get("tokens") or 0) for rnd in self.rounds[:-1] for r in rnd)
        last[0]["tokens"] = int(last[0].get("tokens") or 0) + earlier
        return last

    @property
    def stopped(self) -> bool:
        """Whether the last round stopped before `max_steps` (or never formed)."""
        return self.rendezvous_error is not None or any(r.get("stopped") for r in self.last)


class MembershipWatch(DelegatingHandler):
    """A rendezvous handler that turns "a node is waiting to join" into a graceful stop.

    Everything is delegated to `inner`, except `num_nodes_waiting`: the first time in a round
    that nodes wait, it calls `on_waiting(count)` (which asks the ranks to save and stop at the
    next step) and it always answers 0, so the agent never kills the ranks mid-step for a
    membership change ([Note: membership changes end a round gracefully]).

    Args:
        inner: the real (c10d or etcd-v2) handler.
        on_waiting: called with the number of waiting nodes, once per round.
    """

    def __init__(self, inner: RendezvousHandler, on_waiting: Callable[[int], None]) -> None:
        super().__init__(inner)
        self._on_waiting = on_waiting
        self._lock = threading.Lock()
        self._asked = False

    def arm(self) -> None:
        """Start a new round: the next waiting node triggers `on_waiting` again."""
        with self._lock:
            self._asked = False

    def num_nodes_waiting(self) -> int:
        """Always 0 to the agent; a waiting node triggers `on_waiting` once per round."""
        waiting = self._inner.num_nodes_waiting()
        with self._lock:
            first = waiting > 0 and not self._asked
            self._asked = self._asked or first
        if first:
            self._on_waiting(waiting)
        return 0


class WaitListThrottle(DelegatingHandler):
    """A rendezvous handler that asks `inner` for its wait list at most every `every_s`.

    torch's agent asks at every monitor interval whether nodes wait to join; with c10d that is
    a read of node 0's store from every node. The agent checks its ranks more often than that
    (`_MONITOR_INTERVAL_S`), so between two real asks it gets the last answer. Everything else
    is delegated.

    Args:
        inner: the handler (`MembershipWatch` or `StoreGuard`).
        every_s: the least time between two asks of `inner`.
        clock: a monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        inner: RendezvousHandler,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(inner)
        self._every_s = every_s
        self._clock = clock
        self._asked_at: float | None = None
        self._last = 0

    def num_nodes_waiting(self) -> int:
        """`inner`'s answer, at most `every_s` old."""
        now = self._clock()
        if self._asked_at is None or now - self._asked_at >= self._every_s:
            self._last = self._inner.num_nodes_waiting()
            self._asked_at = now
        return self._last

    def next_rendezvous(self) -> RendezvousInfo:
        """As the inner handler; the next ask after it goes to `inner`."""
        self._asked_at = None
        return self._inner.next_rendezvous()


class _RoundAgent(LocalElasticAgent):
    """torch's local agent, calling a `RoundHook` between each rendezvous and its ranks, and a
    `FailureHook` on each failed attempt (which may end the retries)."""

    def __init__(
        self,
        *args: Any,
        on_rendezvous: RoundHook | None,
        on_failure: FailureHook | None = None,
        on_started: Callable[[], None] | None = None,
        restart_offset: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._on_rendezvous = on_rendezvous
        self._on_failure = on_failure
        self._on_started = on_started
        self._restart_offset = restart_offset

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            # [Note: the recovery timeline] (`bench/recovery_timeline.py`).
            log.debug("rank_failure_seen", ranks=sorted(result.failures))
        if self._on_failure is None or result.state not in (
            WorkerState.FAILED,
            WorkerState.UNHEALTHY,
        ):
            return result
        # torch's own attempt count (`TORCHELASTIC_RESTART_COUNT` of the failed ranks), on top
        # of the earlier rounds'; the agent lowers `_remaining_restarts` only after this.
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        exits = [
            RankExit(local_rank=f.local_rank, rank=rank, exit_code=f.exitcode)
            for rank, f in result.failures.items()
        ]
        try:
            retry = self._on_failure(exits, self._restart_offset + attempt)
        except Exception:  # recording a failure must never cost the group its restart
            log.exception("failure_hook_failed")
            retry = True
        if not retry:
            # [Note: when a failure is not worth a retry] in `failures.py`: the agent then
            # stops the other ranks and returns the failure, as when the budget is spent.
            self._remaining_restarts = 0
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        log.debug("ranks_stopping")
        super()._stop_workers(worker_group)
        log.debug("ranks_stopped")

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        log.debug("rendezvous_done", restart=self._restart_offset + self._attempt())
        if self._on_rendezvous is not None and worker_group.workers:
            # Set by the rendezvous that just ran (`SimpleElasticAgent._rendezvous`; torch
            # declares them None in `WorkerGroup.__init__`).
            group: Any = worker_group
            group_rank, num_nodes = int(group.group_rank), int(group.group_world_size)
            ranks = [w.global_rank for w in worker_group.workers]
            world_size = worker_group.workers[0].world_size
            self._on_rendezvous(worker_group.store, group_rank, num_nodes, ranks, world_size)
        started = super()._start_workers(worker_group)
        log.debug("ranks_started", pids=sorted(started.values()))
        if self._on_started is not None:
            try:
                self._on_started()
            except Exception:  # bookkeeping must never cost the round
                log.exception("ranks_started_hook_failed")
        return started

    def _attempt(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts


def _rendezvous_parameters(cfg: DaemonConfig, endpoint: str) -> RendezvousParameters:
    lc = cfg.launch
    host = endpoint.rsplit(":", 1)[0]
    loopback = host in ("127.0.0.1", "localhost", "::1", "[::1]")
    # [Note: which rendezvous backend] in daemon/config.py: with c10d node 0 hosts the store
    # (said explicitly so two daemons on one host agree); with etcd-v2 no node does.
    backend_options: dict[str, Any] = {"is_host": lc.node_rank == 0}
    if lc.rdzv_backend is RdzvBackend.ETCD_V2:
        backend_options = {}
    return RendezvousParameters(
        backend=lc.rdzv_backend.value,
        endpoint=endpoint,
        run_id=cfg.rdzv_id,
        min_nodes=lc.min_nodes,
        max_nodes=lc.max_nodes,
        local_addr="127.0.0.1" if loopback else None,
        join_timeout=lc.rdzv_timeout_s,
        timeout=lc.rdzv_timeout_s,
        last_call_timeout=lc.rdzv_last_call_s,
        keep_alive_interval=_KEEP_ALIVE_S,
        keep_alive_max_attempt=_KEEP_ALIVE_ATTEMPTS,
        # Both backends read it: a store call that gets no answer in time starts an outage.
        read_timeout=lc.rdzv_store_timeout_s,
        **backend_options,
    )


class ElasticLauncher:
    """Runs this node's rank groups in membership rounds until the job ends for this node.

    Args:
        cfg: effective configuration.
        run_dir: per-run directory (agent logs under `elastic/`, control files).
        entry: the rank entry point, called as
            `entry(cfg, run_dir, daemon_pid, restart_offset, relayed)`.
        endpoint: `host:port` of the rendezvous: node 0's c10d store, or the etcd server.
        on_waiting: elastic jobs only: called when a node waits to join (ask the ranks to stop).
        relay: on a terminal, the daemon's relay of the ranks' output (their stdout/stderr go
            to files it prints above the live line, `relay.py`); None leaves them as they are.
        rank_modules: what `entry` imports when it starts; the fork server imports them
            ahead, with the entry's and the job's modules.
        on_rendezvous: called after each rendezvous, before the ranks start (`RoundHook`).
        on_failure: called on each failed attempt; False ends the retries (`FailureHook`).
        on_started: called after each round's ranks started (the daemon records the named
            semaphores torch made for them: `semaphores.py`).
        incidents: where rendezvous-store outages are incidents (`store_guard.py`), or None.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        run_dir: Path,
        entry: Entry,
        endpoint: str,
        on_waiting: Callable[[int], None],
        relay: RankOutputRelay | None = None,
        rank_modules: Sequence[str] = (),
        on_rendezvous: RoundHook | None = None,
        on_failure: FailureHook | None = None,
        incidents: IncidentLog | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self._cfg = cfg
        self._on_failure = on_failure
        self._on_started = on_started
        self._on_rendezvous = on_rendezvous
        self._relay = relay
        self._run_dir = run_dir
        self._entry = entry
        self._rank_modules = tuple(rank_modules)
        self._server: ForkServer | None = None
        # The daemon drives SIGTERM/SIGINT itself (final checkpoint within its own budget); the
        # agent keeps only SIGQUIT, its "stop the workers now" path (as `elastic_launch` sets).
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
        self._params = _rendezvous_parameters(cfg, endpoint)
        handler = get_rendezvous_handler(self._params)
        # [Note: a waiting node polls the rendezvous faster on few nodes] in rdzv_poll.py.
        if not rdzv_poll.install(handler, cfg.launch.max_nodes):
            log.warning("rendezvous_poll_unchanged", handler=type(handler).__name__)
        # [Note: a store outage is not a crash] in store_guard.py.
        inner = StoreGuard(
            handler,
            endpoint=endpoint,
            grace_s=cfg.launch.rdzv_store_grace_s,
            incidents=incidents,
        )
        self._watch = MembershipWatch(inner, on_waiting) if cfg.launch.elastic else None
        self._handler: RendezvousHandler = WaitListThrottle(
            self._watch or inner, _WAIT_LIST_EVERY_S
        )

    def run(self, stopping: Callable[[], bool]) -> LaunchOutcome:
        """Run rounds until the job is done, this node is stopped, or a round cannot form.

        Args:
            stopping: whether a signal asked this node to stop (no further round then).

        Raises:
            ChildFailedError: the ranks failed more often than `max_restarts` allows.
            RendezvousError: the first rendezvous failed (timeout, unreachable store).
        """
        elastic = self._cfg.launch.elastic
        rounds: list[list[dict[str, Any]]] = []
        restart_offset, restarts_left = 0, self._cfg.launch.max_restarts
        # A fixed-size job closes the rendezvous whatever happens, as torch's launcher does; an
        # elastic one only once it is done, so nodes that stay can form the next round.
        close = not elastic
        try:
            if self._cfg.launch.rank_start is RankStart.FORK_SERVER:
                self._server = self._start_fork_server()
            while True:
                if self._watch is not None:
                    self._watch.arm()
                try:
                    results = self._round(restart_offset, restarts_left)
                except RendezvousError as err:
                    if not rounds:
                        raise
                    log.warning("rendezvous_failed", error=f"{type(err).__name__}: {err}")
                    return LaunchOutcome(rounds=rounds, rendezvous_error=str(err))
                rounds.append(results)
                incarnation = max((int(r.get("restart", 0)) for r in results), default=0)
                restarts_left -= incarnation - restart_offset
                restart_offset = incarnation
                stopped = any(r.get("stopped") for r in results)
                if not stopped:
                    close = True
                if not (elastic and stopped) or stopping():
                    return LaunchOutcome(rounds=rounds)
                # The stop was for a membership change, not for this node: withdraw the request
                # (a signal that came meanwhile is checked right after) and form the next round.
                clear_stop(self._run_dir)
                if stopping():
                    return LaunchOutcome(rounds=rounds)
                step = max((int(r.get("final_step", 0)) for r in results), default=0)
                log.info("membership_round", after_step=step, min_nodes=self._params.min_nodes)
        except SignalException:
            # The agent's own SIGQUIT path: like torch's launcher, leave the rendezvous open
            # (closing it would end the job for every node, for good).
            close = False
            raise
        finally:
            if close:
                self._handler.shutdown()
            if self._server is not None:
                self._server.close()

    def _start_fork_server(self) -> ForkServer | None:
        """The daemon's fork server, or None (ranks are spawned) when it is not usable."""
        modules = preload_modules(self._cfg.train.job, self._entry.__module__, self._rank_modules)
        try:
            server = ForkServer.start(modules, timeout_s=_FORK_SERVER_START_S)
        except ForkServerError as err:
            log.warning("fork_server_unusable", reason=str(err), rank_start=RankStart.SPAWN.value)
            return None
        log.info(
            "fork_server_started",
            pid=server.pid,
            preload_s=round(server.preload_s, 2),
            num_modules=len(modules),
        )
        if server.state.missing:
            # multiprocessing skipped them (ImportError); each rank imports them itself.
            log.warning("fork_server_preload_incomplete", missing=list(server.state.missing))
        return server

    def _logs_specs(self) -> LogsSpecs:
        log_dir = str(self._run_dir / "elastic")
        if self._relay is None:
            return DefaultLogsSpecs(log_dir=log_dir)
        return RelayLogsSpecs(log_dir, self._relay)

    def _round(self, restart_offset: int, max_restarts: int) -> list[dict[str, Any]]:
        lc = self._cfg.launch
        warm = self._server is not None
        spec = WorkerSpec(
            role="trainer",
            local_world_size=lc.nproc_per_node,
            entrypoint=warm_entry(self._entry) if warm else self._entry,
            args=(
                self._cfg,
                str(self._run_dir),
                os.getpid(),
                restart_offset,
                self._relay is not None,
            ),
            rdzv_handler=self._handler,
            max_restarts=max(0, max_restarts),
            monitor_interval=_MONITOR_INTERVAL_S,
            local_addr=self._params.local_addr,
        )
        agent = _RoundAgent(
            spec=spec,
            on_rendezvous=self._on_rendezvous,
            on_failure=self._on_failure,
            on_started=self._on_started,
            restart_offset=restart_offset,
            logs_specs=self._logs_specs(),
            start_method=START_METHOD if warm else "spawn",
            **agent_shutdown_kwargs(LocalElasticAgent),
        )
        result: RunResult | None = agent.run()
        if result is None:
            # torch ends a node that waited as a spare when the job closed the rendezvous.
            raise RendezvousError("the rendezvous closed while this node waited to join")
        if result.is_failed():
            raise ChildFailedError(name="trainer", failures=result.failures)
        return [result.return_values[k] for k in sorted(result.return_values)]
