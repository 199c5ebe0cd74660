"""`trainingd run`: the daemon process from start-up checks to exit code.

    configure logs -> per-run directory -> start-up checks (exit 2) -> the memory tier's
    directory and budget (`memory_budget.py`: exit 2, or durable-only) -> its peer replicas'
    server and sender with several nodes (`replica/`: exit 2 if the address cannot be bound)
    -> HTTP server (exit 2 if the port is taken) -> signal handlers -> supervisor thread ->
    rank fork server (`fork_server.py`) -> torch elastic agent in the main thread, in
    membership rounds (`daemon/agent/elastic.py`: blocks while the ranks train; restarts them
    up to max_restarts;
    with `--nnodes MIN:MAX` a round ended by a peer's stop or a node waiting to join is followed
    by the next one) -> exit 0 when the ranks reached max_steps,
    128+N when a signal N stopped this node (final checkpoint committed; also on a second
    signal, at once), 75 when a peer's stop ended this node's run (fixed `--nnodes N`; elastic:
    only when no new round can form) or the rendezvous store is lost (`store_guard.py`: one
    line), 1 when the ranks failed for good (`max_restarts` spent, or the same error at the
    same step twice: `failures.py`; a short summary on stdout), 2 when the job failed on the
    ranks before training (one line)
    ([Note: exit codes tell finished from stopped]).
A root that already holds a checkpoint at `max_steps` ends the run right after the start-up
checks (one line, exit 0, no rank started). The last lines on stdout say how the run ended
("finished at step N of M" or "stopped at step N (checkpoint committed)") with a summary, and
for a finished run the job's sample of the trained model.

On a terminal (console logs on a TTY) a live status line stands at the bottom of stderr and the
ranks' output is relayed through the daemon so that every line is printed above it
(`progress.py`, `relay.py`); off a terminal, `progress` events are logged instead.

Each fault the node sees (a failed attempt, a hang, a straggler episode, a store outage) is one
incident (`incident_watch.py`, `daemon/observe/incidents.py`): on `/api/status`, in
`<run_dir>/incidents.jsonl` once closed, and made fatal here when the run ends on it.

Signals (the agent is told to handle only SIGQUIT, so these stay ours; see operations.md 9):
SIGTERM/SIGINT -> `draining`: sd_notify `STOPPING=1`, write the stop request the ranks poll;
they agree on a step, save a final checkpoint, finalize and return; the agent returns; exit
128 + the signal (143 for SIGTERM), and 75 on the other nodes (an elastic job's other nodes go
on without this one).
A second SIGTERM/SIGINT kills every rank group and exits at once. SIGUSR1 -> a checkpoint at the
next step boundary.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import structlog

from ckpt_manager import CheckpointError, latest_committed_step, verify_committed_step
from daemon._logging import LogFormat, bind_process_context, configure_logging
from daemon._storage import s3_storage_options
from daemon._version import distribution_version
from daemon.agent import fork_server
from daemon.agent.failures import FailureTracker, Verdict
from daemon.agent.hang import HangDetector
from daemon.agent.http import MetricsServer
from daemon.agent.incident_watch import IncidentWatch
from daemon.agent.memory_budget import start_memory_tier
from daemon.agent.memory_dir import NodeMemoryDir
from daemon.agent.notify import Notifier
from daemon.agent.preflight import check_startup
from daemon.agent.progress import LiveProgress, ProgressEvents
from daemon.agent.relay import RankOutputRelay
from daemon.agent.replica import ReplicaService, announce_without_replicas
from daemon.agent.root_checks import FirstRoundRootChecks
from daemon.agent.straggler import StragglerWatch
from daemon.agent.supervisor import Supervisor
from daemon.config import DaemonConfig
from daemon.errors import ConfigError, StartupCheckError
from daemon.metrics import build_info_labels
from daemon.observe.collector import NodeCollector, SnapshotAggregator, config_values, make_registry
from daemon.observe.hangs import HangLedger
from daemon.observe.incidents import INCIDENTS_FILE, IncidentKind, IncidentLog
from daemon.observe.state import NodePhase, NodeState
from daemon.observe.status import StatusBoard
from daemon.observe.stragglers import StragglerLedger
from daemon.rundir.control import request_checkpoint, request_stop

if TYPE_CHECKING:
    from daemon.agent.elastic import Entry, RoundHook

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_PEER_STOPPED",
    "EXIT_SIGNALLED",
    "exit_code_for",
    "run_daemon",
]

EXIT_OK = 0
"""Ranks reached max_steps: the job is done."""
EXIT_FAILED = 1
"""Ranks failed more often than max_restarts allows, or the shutdown budget ran out."""
EXIT_CONFIG = 2
"""Bad configuration or a failed start-up check; nothing was started."""
EXIT_PEER_STOPPED = 75
"""Stopped cleanly (final checkpoint committed) because another node was stopped: restart me
(EX_TEMPFAIL; systemd `RestartForceExitStatus=75`, Kubernetes podFailurePolicy Ignore)."""
EXIT_SIGNALLED = 128
"""Plus the signal number: this node was stopped by SIGTERM (143) or SIGINT (130), final
checkpoint committed (the shell's convention; systemd `SuccessExitStatus=143`)."""


def exit_code_for(stop_signal: str | None, stopped: bool) -> int:
    """The exit code of a run whose ranks returned cleanly.

    [Note: exit codes tell finished from stopped] A drain or a restart of one node must never
    look like a finished job: a Kubernetes Indexed Job would count as Complete and systemd
    would not restart it. So only reaching `max_steps` exits 0; a node that got the signal exits
    128 + signal, and the other nodes, which stopped only because the stop was agreed across
    ranks, exit 75 so that their supervisor restarts them into the next rendezvous. An elastic
    job's other nodes form the next round themselves instead ([Note: membership changes end a
    round gracefully]); they reach this function stopped only when no round could form.
    """
    if stop_signal is not None:
        return EXIT_SIGNALLED + int(signal.Signals[stop_signal])
    if stopped:
        return EXIT_PEER_STOPPED
    return EXIT_OK


log = structlog.get_logger("trainingd.daemon")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_run_dir(cfg: DaemonConfig) -> tuple[Path, bool]:
    """The per-run directory and whether we created it (and so remove it at exit)."""
    if cfg.launch.run_dir:
        path = Path(cfg.launch.run_dir)
        for sub in ("ranks", "control"):
            shutil.rmtree(path / sub, ignore_errors=True)
        return path, False
    base = os.environ.get("RUNTIME_DIRECTORY") or None  # set by systemd's RuntimeDirectory=
    prefix = f"trainingd-{cfg.run_id}-node{cfg.launch.node_rank}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base)), True


def _rdzv_endpoint(cfg: DaemonConfig) -> str:
    """`host:port` of the c10d rendezvous: the configured one, or a free loopback port."""
    return cfg.launch.rdzv_endpoint or f"127.0.0.1:{_free_port()}"


def _already_complete(cfg: DaemonConfig) -> str | None:
    """The one line that ends a run whose root already holds `max_steps` (and that step
    verifies), or None to train."""
    uri = cfg.checkpoint.ckpt_uri
    try:
        latest = latest_committed_step(uri, s3_storage_options(cfg))
    except CheckpointError:
        return None  # the ranks' own restore reports a root that cannot be listed
    if latest is None or latest < cfg.train.max_steps:
        return None
    # The final step must restore, or the run is not done: the ranks then quarantine it,
    # restore the newest step that verifies and train to `max_steps` again (#32).
    try:
        problem = verify_committed_step(uri, latest, s3_storage_options(cfg))
    except CheckpointError:
        return None
    if problem is not None:
        log.warning("final_step_fails_verification", ckpt_step=latest, problem=problem)
        return None
    return (
        f"trainingd: already at step {latest} of {cfg.train.max_steps} in {uri}; "
        "pass --max-steps N to train further, or a new --ckpt-uri"
    )


def _ckptctl() -> str:
    """How to call ckptctl from here: its name if on PATH, else the venv's copy beside us."""
    beside = Path(sys.executable).parent / "ckptctl"
    if shutil.which("ckptctl") is not None or not beside.exists():
        return "ckptctl"
    relative = os.path.relpath(beside)
    return str(beside) if relative.startswith("..") else relative


def _ending(
    cfg: DaemonConfig, results: Iterable[dict[str, Any]], stop_signal: str | None, wall_s: float
) -> str:
    """The lines that end a run: how it ended, a summary, and where its checkpoints are."""
    ranks = list(results)
    final = max((int(r.get("final_step", 0)) for r in ranks), default=0)
    start = min((int(r.get("start_step", 0)) for r in ranks), default=0)
    loss = next((r["loss"] for r in ranks if r.get("loss") is not None), None)
    num_tokens = sum(int(r.get("tokens") or 0) for r in ranks)
    if stop_signal is not None or any(r.get("stopped") for r in ranks):
        how = f"stopped at step {final} (checkpoint committed)"
        if final == 0:
            how = "stopped at step 0 (nothing trained, no checkpoint)"
        if stop_signal is not None:
            how += f" on {stop_signal}"
    else:
        how = f"finished at step {final} of {cfg.train.max_steps}"
    summary = [f"{final - start} steps in {wall_s:.1f} s wall time"]
    if loss is not None:
        summary.append(f"final loss {loss:.4f}")
    if num_tokens and wall_s > 0:
        summary.append(f"{num_tokens / wall_s:,.0f} tokens/s on this node")
    uri = cfg.checkpoint.ckpt_uri
    lines = [
        f"trainingd: run {cfg.run_id} {how}: {', '.join(summary)}",
        f"trainingd: checkpoints in {uri}; list them with `{_ckptctl()} list {uri}`",
    ]
    sample = next((r["sample"] for r in ranks if r.get("sample")), None)
    if sample is not None:
        lines.append("trainingd: sample of the trained model:")
        lines.extend(f"    {line}" for line in str(sample).splitlines())
    return "\n".join(lines)


class _Signals:
    """SIGTERM/SIGINT/SIGUSR1 handlers of the daemon's main thread."""

    def __init__(
        self,
        state: NodeState,
        run_dir: Path,
        notifier: Notifier,
        supervisor: Supervisor,
        memory: NodeMemoryDir,
    ) -> None:
        self._state, self._run_dir = state, run_dir
        self._notifier, self._supervisor = notifier, supervisor
        self._memory = memory
        self.stop_signal: str | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_checkpoint)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self._state.request_stop():
            # Second signal: no more waiting for a final checkpoint. No `finally` runs after
            # os._exit: the memory tier goes here ([Note: who may remove a memory-tier
            # directory] in memory_dir.py), once no rank can write into it.
            self._supervisor.kill_all()
            self._memory.release()
            os._exit(128 + signum)
        self.stop_signal = name
        self._notifier.send(STOPPING=1, STATUS=f"{name}: saving a final checkpoint")
        request_stop(self._run_dir, name)
        log.warning("stop_requested", signal=name, note="a second signal exits at once")

    def _on_checkpoint(self, signum: int, frame: FrameType | None) -> None:
        request_id = request_checkpoint(self._run_dir)
        log.info("checkpoint_requested", signal="SIGUSR1", request=request_id)


def run_daemon(
    cfg: DaemonConfig,
    entry: Entry,
    *,
    started: float | None = None,
    rank_modules: Sequence[str] = (),
) -> int:
    """Run this node's part of the job; returns the process exit code.

    Args:
        cfg: the effective configuration.
        entry: the function the elastic agent runs in every rank process
            (`daemon.worker.elastic_entry`; `cli.py` hands it over, so this side never imports
            the rank side).
        started: `time.monotonic()` when the command started (the summary's wall time counts
            from there: importing torch alone takes seconds); None: from this call.
        rank_modules: what `entry` imports when it starts (`daemon.worker.RANK_MODULES`): the
            rank fork server imports them ahead (`daemon/agent/fork_server.py`).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from daemon.agent.elastic import ElasticLauncher

    started = time.monotonic() if started is None else started
    obs = cfg.observability
    chosen = configure_logging(obs.log_format, level=obs.log_level.upper())
    bind_process_context(node=cfg.launch.node_rank, run_id=cfg.run_id, role="daemon")
    run_dir, owned = _make_run_dir(cfg)
    notifier = Notifier()
    state = NodeState(local_ranks=cfg.launch.nproc_per_node)
    server: MetricsServer | None = None
    supervisor: Supervisor | None = None
    board: StatusBoard | None = None
    live: LiveProgress | None = None
    relay: RankOutputRelay | None = None
    memory: NodeMemoryDir | None = None
    replicas: ReplicaService | None = None

    def end_display() -> None:
        # Every relayed rank line first, then the status line goes: the ending follows below.
        if relay is not None:
            relay.close()
        if live is not None:
            live.close()

    try:
        try:
            check_startup(cfg, run_dir)
            complete = _already_complete(cfg)
            if complete is not None:
                print(complete, flush=True)
                return EXIT_OK
            cfg, memory = start_memory_tier(cfg)
            endpoint = _rdzv_endpoint(cfg)
            if cfg.num_memory_replicas and memory.claimed:
                replicas = ReplicaService(cfg, memory.path, endpoint)
            aggregator = SnapshotAggregator(run_dir, cfg.launch.nproc_per_node)
            # One story per fault: `daemon/observe/incidents.py`, `incident_watch.py`.
            incidents = IncidentLog(node=cfg.launch.node_rank, path=run_dir / INCIDENTS_FILE)
            watch = IncidentWatch(incidents, run_dir, local_ranks=cfg.launch.nproc_per_node)
            hangs = HangLedger(incidents)
            stragglers = StragglerLedger(incidents)
            board = StatusBoard(
                max_steps=cfg.train.max_steps,
                ckpt_uri=cfg.checkpoint.ckpt_uri,
                storage_options=s3_storage_options(cfg, "status"),
                tier_bytes=memory.tier_bytes,
                hangs=hangs,
                stragglers=stragglers,
                incidents=incidents,
                run_id=cfg.run_id,
            )
            failures = FailureTracker(
                run_dir,
                node=cfg.launch.node_rank,
                hung=lambda: dict.fromkeys(hangs.hung_ranks(), True),
                board=board,
                local_ranks=cfg.launch.nproc_per_node,
                incidents=watch,
            )
            collector = NodeCollector(
                aggregator,
                state,
                build_info_labels(distribution_version()),
                run_id=cfg.run_id,
                config=config_values(cfg),
                tier_bytes=memory.tier_bytes,
                replica_values=replicas.values if replicas is not None else None,
                hangs=hangs,
                failure_counts=failures.counts,
                stragglers=stragglers,
                incident_counts=incidents.counts,
            )
            if chosen is LogFormat.CONSOLE and sys.stderr.isatty():
                live = LiveProgress(board)
            supervisor = Supervisor(
                state,
                aggregator,
                notifier,
                heartbeat_timeout_s=obs.heartbeat_timeout_s,
                shutdown_timeout_s=cfg.launch.shutdown_timeout_s,
                progress=live or ProgressEvents(board, obs.log_every_s),
                board=board,
                hangs=HangDetector(
                    run_dir,
                    node=cfg.launch.node_rank,
                    hang_timeout_s=obs.hang_timeout_s.seconds,
                    startup_timeout_s=obs.heartbeat_timeout_s,
                    ledger=hangs,
                ),
                stragglers=StragglerWatch(
                    threshold=obs.straggler_threshold,
                    action=obs.straggler_action,
                    ledger=stragglers,
                ),
                incidents=watch,
            )
            try:
                server = MetricsServer(
                    make_registry(collector),
                    state,
                    supervisor.rank_heartbeats,
                    heartbeat_timeout_s=obs.heartbeat_timeout_s,
                    host=obs.metrics_host,
                    port=obs.metrics_port,
                    status=board.snapshot,
                ).start()
            except OSError as err:
                raise StartupCheckError(
                    f"metrics_port={obs.metrics_port} on {obs.metrics_host}: cannot bind "
                    f"({err.strerror}); pick another port or 0 for a free one"
                ) from None
        except ConfigError as err:
            print(f"trainingd: {err}", file=sys.stderr)
            return EXIT_CONFIG
        url = f"http://{server.host}:{server.port}"
        board.start()
        if live is not None:
            # From here on the daemon's console is the terminal's only writer (progress.py).
            live.start()
            configure_logging(
                LogFormat.CONSOLE, level=obs.log_level.upper(), stream=live.log_stream()
            )
            relay = RankOutputRelay(live.print_line).start()
        log.info(
            "daemon_started",
            status=f"{url}/",
            metrics=f"{url}/metrics",
            health=f"{url}/healthz",
            checkpoints=cfg.checkpoint.ckpt_uri,
            run_dir=str(run_dir),
            nproc_per_node=cfg.launch.nproc_per_node,
            nnodes=cfg.launch.nnodes,
            strategy=cfg.train.strategy.value,
        )
        signals = _Signals(state, run_dir, notifier, supervisor, memory)
        signals.install()
        supervisor.start()
        state.update(phase=NodePhase.RENDEZVOUS)
        # [Note: a fresh worker store per restart] By default the ranks' process group
        # bootstraps through the agent's shared rendezvous store under the same keys in every
        # attempt; after a restart a rank can read the dead attempt's gloo addresses and fail
        # with "connection refused". Unshared, each attempt gets its own store (rank 0 hosts it
        # on a port the agent picks per round).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        try:
            launcher = ElasticLauncher(
                cfg,
                run_dir,
                entry,
                endpoint,
                on_waiting=lambda waiting: _on_nodes_waiting(run_dir, waiting),
                relay=relay,
                rank_modules=rank_modules,
                on_rendezvous=_round_hook(cfg, replicas),
                on_failure=lambda exits, restart: failures.record(exits, restart) is Verdict.RETRY,
                incidents=incidents,
                on_started=memory.record_semaphores if memory is not None else None,
            )
            outcome = launcher.run(stopping=lambda: signals.stop_signal is not None)
        except RendezvousError as err:
            # The store's host is lost or paused past the grace, or the first rendezvous could
            # not form ([Note: a store outage is not a crash] in store_guard.py): restart me.
            end_display()
            complete = _already_complete(cfg)
            if complete is not None:  # a closed rendezvous: the job is done elsewhere
                print(complete, flush=True)
                return EXIT_OK
            line = _rendezvous_line(cfg, err)
            board.note_error(line)
            if not incidents.is_open(IncidentKind.STORE_OUTAGE):  # the guard's, if it saw one
                incidents.open(IncidentKind.STORE_OUTAGE, ranks=(), cause=line)
            incidents.end_open_as_fatal()
            log.error("rendezvous_lost", endpoint=endpoint, error=line, exit_code=EXIT_PEER_STOPPED)
            print(f"trainingd: {line}", file=sys.stderr, flush=True)
            return EXIT_PEER_STOPPED
        except ChildFailedError as err:
            end_display()  # the ranks' last lines (their tracebacks) come before this record
            incidents.end_open_as_fatal()  # the failures' incidents: the run ends on them
            return _failed(cfg, failures, board, err)
        except StartupCheckError as err:  # the root's checks in this node's first round
            end_display()
            board.note_error(str(err))
            log.error("startup_check_failed", error=str(err), exit_code=EXIT_CONFIG)
            print(f"trainingd: {err}", file=sys.stderr, flush=True)
            return EXIT_CONFIG
        if supervisor.budget_exceeded.is_set():
            return EXIT_FAILED
        supervisor.end_progress()  # off a terminal: the last `progress` event is the run's end
        results = outcome.summary_results()
        final = max((r.get("final_step", 0) for r in results), default=None)
        code = exit_code_for(signals.stop_signal, outcome.stopped)
        if outcome.rendezvous_error is not None and code == EXIT_PEER_STOPPED:
            # A later round could not form; if the job is done elsewhere, so is this node.
            code = EXIT_OK if _already_complete(cfg) is not None else code
        # The run ended on purpose: one scrape must read it before the target vanishes
        # ([Note: the last scrape must say finished]).
        state.update(phase=NodePhase.STOPPED)
        final_scrape = server.scrapes.wait_for_final(obs.final_scrape_wait_s)
        log.info(
            "daemon_finished",
            final_step=final,
            stopped_by=signals.stop_signal,
            exit_code=code,
            final_scrape=final_scrape.value,
        )
        wall_s = time.monotonic() - started
        end_display()
        print(_ending(cfg, results, signals.stop_signal, wall_s))
        sys.stdout.flush()
        return code
    finally:
        end_display()
        fork_server.stop_unclaimed()  # launched by `cli`, never reached the launcher
        state.update(phase=NodePhase.STOPPED)
        notifier.send(STOPPING=1)
        if supervisor is not None:
            supervisor.kill_all()
            supervisor.close()
        if replicas is not None:  # nothing reads or writes the tier's directory after this
            replicas.close()
        if memory is not None:  # after kill_all: no rank writes into it any more
            memory.release()
        if server is not None:
            server.close()
        if board is not None:
            board.close()
        notifier.close()
        if owned:
            shutil.rmtree(run_dir, ignore_errors=True)


def _failed(cfg: DaemonConfig, failures: FailureTracker, board: StatusBoard, err: Exception) -> int:
    """End a run whose ranks failed for good: the record, the lines, the exit code.

    A failure of the job or its configuration before training exits 2 with one line on
    stderr, as a start-up check; a deterministic one, or a spent restart budget, exits 1 with
    a short summary on stdout ([Note: when a failure is not worth a retry] in `failures.py`).
    """
    if failures.verdict is Verdict.CONFIG:
        line = failures.config_line()
        board.note_error(line)
        log.error("workers_failed", verdict=failures.verdict.value, error=line)
        print(f"trainingd: {line}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if failures.verdict is Verdict.DETERMINISTIC:
        lines = failures.summary_lines()
        board.note_error(lines[0])
        log.error("workers_failed", verdict=failures.verdict.value, error=lines[0])
        lines[0] = f"run {cfg.run_id} {lines[0]}"
    else:
        restarts = cfg.launch.max_restarts
        board.note_error(f"workers failed for good: {err}")
        log.error("workers_failed", max_restarts=restarts, error=str(err))
        lines = [f"run {cfg.run_id} failed: the ranks failed after {restarts} restarts"]
        last = failures.last_failure_line()
        if last is not None:
            lines.append(f"  {last}")
    print("\n".join(f"trainingd: {line}" for line in lines), flush=True)
    return EXIT_FAILED


def _round_hook(cfg: DaemonConfig, replicas: ReplicaService | None) -> RoundHook | None:
    """What runs after each rendezvous of a multi-node job: the replica ring's, or, on a node
    that keeps none, its empty part in the address exchange (the others must not wait); then,
    in this node's first round, the checkpoint root's checks unless the job already ran a
    round ([Note: a node joining a running job skips the root checks] in `root_checks.py`)."""
    if cfg.launch.max_nodes == 1:
        return None
    inner = (
        replicas.on_rendezvous if replicas is not None else announce_without_replicas(cfg.run_id)
    )
    return FirstRoundRootChecks(cfg, inner)


def _rendezvous_line(cfg: DaemonConfig, err: BaseException) -> str:
    """One line for a rendezvous that failed or a store that is lost (exit 75)."""
    lc = cfg.launch
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        reason += f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0]})"
    return (
        f"rendezvous at {lc.rdzv_endpoint or 'loopback'} ({lc.rdzv_backend.value}) failed: "
        f"{reason}; exit 75 (restart me once the rendezvous host is back)"
    )


def _on_nodes_waiting(run_dir: Path, waiting: int) -> None:
    """A node waits to join: the ranks save and stop at the next step, then the job regrows."""
    request_stop(run_dir)
    log.info("membership_change_requested", nodes_waiting=waiting)
