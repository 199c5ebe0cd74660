"""The rank process: what the elastic agent (or a plain `torchrun`) starts on each local rank.

Under `trainingd run` the daemon's in-process elastic agent calls `elastic_entry(cfg, run_dir,
daemon_pid, restart_offset, relayed)` in a process forked from the daemon's fork server, which
has imported `RANK_MODULES` and the job already (or in a spawned one, `rank_start = "spawn"`;
`daemon/agent/fork_server.py`), one agent per membership round (`daemon/agent/elastic.py`;
`relayed`: the daemon prints this rank's output on its terminal, see `daemon/agent/relay.py`).
Under plain torchrun, run the module with the same config flags as `trainingd run` (a run
directory enables the snapshot/control files):

    torchrun --nproc-per-node 2 -m daemon.worker --max-steps 100 --ckpt-uri /tmp/ck

Both read the rank layout from torchrun's environment (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`, `GROUP_RANK`). Start-up order matters:
become a process-group leader and start the parent watch before anything can spawn (see
`daemon/_lifecycle.py`), publish a first snapshot (so the daemon knows the pid), then join the
process group, build the job and train. A rank whose entry point raises writes why into the
run directory before it exits (`daemon/rundir/failure.py`: exception, step, phase, whether the
job or its configuration failed before training), for the daemon's `agent/failures.py`.

On CUDA (`--device`, `daemon/_device.py`) local rank `r` trains on GPU `r`: the device is set
before the process group exists, so NCCL binds each rank to its own GPU.

Importing this module loads no torch: the daemon imports it (for `elastic_entry` and
`RANK_MODULES`) before it launches its fork server, which must start importing while the
daemon has not ([Note: the server imports while the daemon does] in
`daemon/agent/fork_server.py`). torch's error recording is applied when an entry point runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import structlog

from daemon._config_load import add_config_flags, load_config
from daemon._lifecycle import ParentWatch, become_group_leader
from daemon._logging import LogFormat, bind_process_context, configure_logging
from daemon.config import DaemonConfig
from daemon.errors import ConfigError, JobError
from daemon.rank.telemetry import NullTelemetry, RankTelemetry
from daemon.rundir.control import RankControl
from daemon.rundir.failure import error_path, rank_error, write_error
from daemon.rundir.progress import progress_path
from daemon.rundir.snapshot import RankPhase, snapshot_path
from daemon.rundir.stacks import install_stack_dump

__all__ = ["RANK_MODULES", "elastic_entry", "main", "run_rank"]

_COLLECTIVE_TIMEOUT = timedelta(seconds=300)
_F = TypeVar("_F", bound=Callable[..., Any])

RANK_MODULES = (
    "torch.distributed",
    "torch._dynamo",
    "sharding",
    "ckpt_manager",
    "daemon._device",
    "daemon._storage",
    "daemon.jobs.job",
    "daemon.rank.loop",
    # What `_Training` imports from `ckpt_manager` by name: the package's public names are
    # lazy, so importing it alone leaves the manager and its 60 modules to each rank
    # (0.1-0.25 s of every restart's critical path; [Note: the recovery timeline]).
    "ckpt_manager._manager",
    "daemon.rank.token_data",
)
"""What a rank imports when it starts, besides this module and the job: what `run_rank` and
the loop import lazily (so that the daemon, which imports this module for `elastic_entry`, does
not load the rank side), and `torch._dynamo`, which torch itself imports at a rank's first
parameter initialisation (seconds). The daemon's fork server imports them ahead
(`daemon/cli.py` hands them over)."""


def _recorded(entry: _F) -> _F:
    """torch elastic's `record` (the error file the agent reads), applied when `entry` runs, so
    that importing this module stays torch-free."""

    @functools.wraps(entry)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(entry)(*args, **kwargs)

    return cast(_F, recorded)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value is not None else default


def run_rank(
    cfg: DaemonConfig,
    run_dir: Path | None,
    parent_pid: int,
    *,
    supervised: bool,
    restart_offset: int = 0,
    relayed: bool = False,
) -> dict[str, Any]:
    """Run one rank to the end of training; returns a small summary.

    Args:
        cfg: effective configuration.
        run_dir: per-run directory for snapshots and control files (None: none).
        parent_pid: the supervising process (the daemon, or torchrun's agent); this rank
            kills its group if that one dies (or its fork server, see `daemon/_lifecycle.py`).
        supervised: started by `trainingd run` (stop requests arrive as files).
        restart_offset: group restarts of the daemon's earlier membership rounds; added to the
            agent's `TORCHELASTIC_RESTART_COUNT`, which starts at 0 in every round.
        relayed: stdout/stderr are files the daemon prints on its terminal: log in colour for
            that terminal although stderr is a file.
    """
    import torch
    import torch.distributed as dist

    from daemon._device import process_group_backend, resolve_device
    from daemon.jobs.job import JobContext, load_job
    from daemon.rank.loop import run_training
    from daemon.rank.token_data import with_token_data

    become_group_leader()
    # The daemon is the parent of a spawned rank and the grandparent of a forked one.
    watch = ParentWatch.of_supervisor(parent_pid).start()
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    restart = restart_offset + _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    configure_logging(
        LogFormat.CONSOLE if relayed else cfg.observability.log_format,
        level=cfg.observability.log_level.upper(),
        colors=True if relayed else None,
    )
    bind_process_context(
        rank=rank,
        local_rank=local_rank,
        # Under the daemon, the node is its `node_rank` (the label its own lines, metrics and
        # the hang detector use); c10d's group rank orders nodes by host and pid and may
        # differ. Under plain torchrun the group rank is all there is.
        node=cfg.launch.node_rank if run_dir is not None else _env_int("GROUP_RANK", 0),
        run_id=cfg.run_id,
        restart=restart,
        # Names the process where the restart count cannot: another node's failure restarts
        # this node's ranks without counting a restart (torch's membership change).
        pid=os.getpid(),
    )
    log = structlog.get_logger("trainingd.worker")
    # [Note: the recovery timeline] (`bench/recovery_timeline.py`): one debug line per stage.
    log.debug("rank_entered")
    # Without a run directory (plain torchrun) no agent reads the snapshots: record nothing.
    telemetry: RankTelemetry | NullTelemetry = (
        NullTelemetry()
        if run_dir is None
        else RankTelemetry(
            snapshot_path(run_dir, local_rank),
            rank=rank,
            world_size=world_size,
            restart=restart,
            publish_interval_s=cfg.observability.publish_interval_s,
            progress=progress_path(run_dir, local_rank),
        )
    )
    if run_dir is not None:
        install_stack_dump(run_dir, rank)
    telemetry.heartbeat(RankPhase.STARTING)
    # Under the daemon, stop requests come as files; SIGTERM keeps its default action so the
    # elastic agent can end a rank at once when it restarts the group. Under plain torchrun the
    # rank turns SIGTERM/SIGINT into a graceful stop (torchrun forwards them to its workers).
    control = RankControl(run_dir, graceful_signals=not supervised)
    torch.set_num_threads(cfg.train.threads_per_rank)
    building_job = False
    try:
        device = resolve_device(cfg.train.device, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device), timeout=_COLLECTIVE_TIMEOUT)
        log.debug("process_group_up")
        torch.manual_seed(cfg.train.seed)
        building_job = True
        job = load_job(cfg.train.job)(
            JobContext(rank=rank, world_size=world_size, seed=cfg.train.seed)
        )
        job = with_token_data(cfg, job)  # --data / --val-data: the job's model on token files
        building_job = False
        log.debug("job_loaded")
        telemetry.heartbeat(RankPhase.LOADING)
        log.info("device_selected", device=str(device), backend=dist.get_backend())
        result = run_training(cfg, job, telemetry=telemetry, control=control, device=device)
        log.info(
            "rank_finished",
            final_step=result.final_step,
            stopped=result.stopped,
            loss=result.last_loss,
        )
        dist.barrier()
    except Exception as err:
        # The agent keeps only the first failure's traceback; every rank's goes to the log.
        log.exception("rank_failed")
        if isinstance(telemetry, RankTelemetry) and run_dir is not None:
            # [Note: the rank writes its own error file] in `daemon/rundir/failure.py`.
            step = _failed_step(telemetry)
            record = rank_error(
                err,
                rank=rank,
                local_rank=local_rank,
                restart=restart,
                phase=telemetry.phase.value,
                step=step,
                config=step is None and _is_config_failure(err, building_job),
            )
            try:
                write_error(error_path(run_dir, local_rank), record)
            except OSError as write_err:  # the failure itself must still reach the agent
                log.warning("rank_error_file_failed", error=str(write_err))
        raise
    else:
        return {
            "final_step": result.final_step,
            "start_step": result.start_step,
            "stopped": result.stopped,
            "loss": result.last_loss,
            "tokens": result.num_tokens,
            "restart": restart,
            "world_size": world_size,
            "sample": result.sample,
        }
    finally:
        telemetry.heartbeat(RankPhase.EXITED)
        telemetry.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        watch.close()


def _failed_step(telemetry: RankTelemetry) -> int | None:
    """The step a failing rank was in: the last completed one + 1 in the training loop, the
    last completed one in its checkpoint call or while its final save is committed, None
    before training started."""
    phase = telemetry.phase
    completed = telemetry.snapshot()["gauges"].get("trainingd_train_step", {}).get("")
    if completed is None or phase not in _IN_TRAINING:
        return None
    return int(completed) + (1 if phase is RankPhase.TRAINING else 0)


_IN_TRAINING = frozenset(
    {RankPhase.TRAINING, RankPhase.CHECKPOINTING, RankPhase.STOPPING, RankPhase.FINISHING}
)


def _is_config_failure(err: BaseException, building_job: bool) -> bool:
    """Whether a failure before training comes from the job or its configuration (exit 2).

    The job's import or build raising, whatever the exception (it is the job's own code), and,
    later before the first step, a `JobError` (`--init-from` weights that do not fit, a job
    that returned something else than a `JobSpec`), a `ConfigError` or an `ImportError`.
    """
    return building_job or isinstance(err, JobError | ConfigError | ImportError)


@_recorded
def elastic_entry(
    cfg: DaemonConfig,
    run_dir: str,
    daemon_pid: int,
    restart_offset: int = 0,
    relayed: bool = False,
) -> dict[str, Any]:
    """Entry point the daemon's elastic agent runs in every rank process."""
    return run_rank(
        cfg,
        Path(run_dir),
        daemon_pid,
        supervised=True,
        restart_offset=restart_offset,
        relayed=relayed,
    )


@_recorded
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m daemon.worker [config flags]` under plain torchrun."""
    parser = argparse.ArgumentParser(
        prog="python -m daemon.worker",
        allow_abbrev=False,
        description="One trainingd rank under torchrun (same config flags as `trainingd run`).",
    )
    parser.add_argument("--config", type=Path, default=None, help="TOML config file")
    add_config_flags(parser)
    args = vars(parser.parse_args(argv))
    config_file = args.pop("config")
    try:
        cfg = load_config(args, file=config_file)
    except ConfigError as err:
        print(f"trainingd worker: {err}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.launch.run_dir) if cfg.launch.run_dir else None
    run_rank(cfg, run_dir, os.getppid(), supervised=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
