"""Start-up checks run by `trainingd run` before any rank starts.

Each check raises `StartupCheckError` with one line saying what is wrong and how to fix it; the
CLI turns it into exit code 2 (systemd's `RestartPreventExitStatus=2` stops a restart loop on a
config that can never work). Checks: the job can be imported, the checkpoint root is reachable
and writable (a probe file is written and removed; for S3 the endpoint must accept a TCP
connection within a few seconds and the bucket must exist), no other live process holds the
root's lease (the one line names its host, pid, run id and last refresh; see
`ckpt_manager.check_root_lease`), the per-run directory is writable, the configured device
exists (`--device cuda` on a node without CUDA, or more ranks than GPUs), `rdzv_backend =
"etcd-v2"` has its client library (`python-etcd`), and `--init-from` weights fit the job's model
(names, shapes, dtypes: `daemon/jobs/init_from.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
import uuid
from pathlib import Path

from ckpt_manager import (
    CheckpointError,
    LeaseHeldError,
    StorageError,
    check_root_lease,
    check_root_writable,
)
from daemon._device import cuda_problem
from daemon._storage import s3_storage_options
from daemon.config import DaemonConfig, RdzvBackend
from daemon.errors import StartupCheckError

__all__ = ["check_root_access", "check_startup"]

_CONNECT_TIMEOUT_S = 3.0


def _check_job(cfg: DaemonConfig) -> None:
    from daemon.errors import JobError
    from daemon.jobs.job import load_job

    try:
        load_job(cfg.train.job)
    except JobError as err:
        raise StartupCheckError(str(err)) from None


def _check_rendezvous(cfg: DaemonConfig) -> None:
    # Without it torch falls back to a stub that fails at the first rendezvous, with a traceback.
    if cfg.launch.rdzv_backend is RdzvBackend.ETCD_V2 and importlib.util.find_spec("etcd") is None:
        raise StartupCheckError(
            "rdzv_backend=etcd-v2 needs the python-etcd package: "
            "pip install 'trainingd[etcd]' (or python-etcd==0.4.5), or use rdzv_backend=c10d"
        )


def _check_local_dir(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".trainingd-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise StartupCheckError(f"{what} {path} is not writable: {reason}") from None


def _check_root(cfg: DaemonConfig) -> None:
    uri = cfg.checkpoint.ckpt_uri
    try:
        # Each store checks in its own way (`ckpt_manager.check_root_writable`).
        check_root_writable(uri, s3_storage_options(cfg), timeout_s=_CONNECT_TIMEOUT_S)
    except StorageError as err:
        raise StartupCheckError(f"ckpt_uri={uri!r}: {err}") from None


def _check_lease(cfg: DaemonConfig) -> None:
    uri = cfg.checkpoint.ckpt_uri
    try:
        # A node of a multi-node job (re)joining it, e.g. a fresh daemon replacing a lost node,
        # finds the lease held by the job's own coordinator, or by a coordinator of it that
        # died and will take it over once the ranks train again ([Note: the root opens after a
        # memory restore] in ckpt_manager/_root.py): its run id passes at once instead of a
        # watch of half the lease's ttl (60 s by default) for a refresh that is not coming.
        # Another run's live lease still fails the start; a second launch of the same run id
        # is fenced by the coordinator's own acquisition.
        joining = cfg.run_id if cfg.launch.max_nodes > 1 else None
        check_root_lease(uri, s3_storage_options(cfg), joining_run_id=joining)
    except LeaseHeldError as err:
        raise StartupCheckError(f"ckpt_uri={uri!r}: {err}") from None
    except CheckpointError as err:
        raise StartupCheckError(f"ckpt_uri={uri!r}: cannot read its lease: {err}") from None


def _resuming(cfg: DaemonConfig) -> bool:
    """Whether the root holds a committed step (a resumed run ignores `--init-from`)."""
    from ckpt_manager import latest_committed_step

    try:
        return latest_committed_step(cfg.checkpoint.ckpt_uri, s3_storage_options(cfg)) is not None
    except CheckpointError:
        return False  # an unreadable root is reported by the storage checks below


def _check_init_from(cfg: DaemonConfig) -> None:
    """`--init-from` against the job's model, from the safetensors headers only.

    The job is built once here, its tensors on the meta device (no memory), so a mismatch
    ends the run with exit 2 before any rank starts (falls back to the CPU for a job whose
    construction cannot run on meta tensors).
    """
    import torch

    from daemon.errors import JobError
    from daemon.jobs.init_from import check_source, storage_options_for
    from daemon.jobs.job import JobContext, load_job

    uri = cfg.train.init_from
    context = JobContext(rank=0, world_size=cfg.launch.nproc_per_node, seed=cfg.train.seed)
    try:
        build = load_job(cfg.train.job)
        try:
            with torch.device("meta"):
                job = build(context)
        except Exception:  # any job code may refuse meta tensors: build it for real
            try:
                job = build(context)
            except Exception as err:  # the job's own code: its failure is a start-up one
                raise JobError(
                    f"job={cfg.train.job!r}: its build raised {type(err).__name__}: {err}"
                ) from err
        check_source(
            job.model,
            uri,
            job.init_key_map,
            storage_options_for(uri, cfg.checkpoint.s3_endpoint_url),
        )
    except JobError as err:
        raise StartupCheckError(str(err)) from None


def check_startup(cfg: DaemonConfig, run_dir: Path) -> None:
    """Run every start-up check (a node of a multi-node job checks its checkpoint root in its
    first round instead: `root_checks.py`).

    Raises:
        StartupCheckError: the first failing check, as one line.
    """
    problem = cuda_problem(cfg.train.device, cfg.launch.nproc_per_node)
    if problem is not None:
        raise StartupCheckError(problem)
    _check_rendezvous(cfg)
    _check_job(cfg)
    if cfg.train.init_from and not _resuming(cfg):
        _check_init_from(cfg)
    if cfg.launch.max_nodes == 1:
        # A node of a multi-node job checks the root after its first rendezvous, and not at
        # all when it joins a job that already ran a round ([Note: a node joining a running
        # job skips the root checks] in `root_checks.py`).
        check_root_access(cfg)
    _check_local_dir(run_dir, "run directory")


def check_root_access(cfg: DaemonConfig) -> None:
    """The checkpoint root is writable and no other live run holds its lease.

    Raises:
        StartupCheckError: it is not (one line naming the root, and the holder).
    """
    _check_root(cfg)
    _check_lease(cfg)
