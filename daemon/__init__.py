"""trainingd's per-node service: launches local ranks, trains, checkpoints, exports metrics.

`daemon` composes the two engines (`sharding`, `ckpt_manager`) and is the only package that
knows Prometheus, systemd and the elastic launcher. This import name is ours: trainingd never
depends on the unrelated `python-daemon` distribution (a test pins that `daemon` resolves here).

Module plan:
    cli.py           `trainingd` console script: `run`, `config show`.
    config.py        frozen per-component settings (`DaemonConfig` and its four sections).
    _config_load.py  TOML + `TRAININGD_*` + flags -> `DaemonConfig`; precedence, messages.
    _preflight.py    start-up checks (job importable, storage reachable and writable, the
                     device available) -> exit 2.
    _device.py       `device` auto|cpu|cuda -> this rank's torch device and collective backend.
    _run.py          the daemon process: HTTP server, signals, supervisor, elastic agent.
    _elastic.py      the elastic agent in membership rounds: shrink and grow (`MIN:MAX`).
    _supervisor.py   supervisor thread: phase/readiness, sd_notify, orphan reaping, progress.
    _progress.py     the live status line on a terminal, `progress` log events off it.
    _relay.py        on a terminal: the ranks' output, redirected to files, printed by the daemon.
    _state.py        `NodeState` / `NodePhase`: starting -> rendezvous -> loading -> training
                     <-> checkpointing; any -> draining -> stopped.
    _http.py         one port: /metrics, /healthz, /readyz.
    _notify.py       sd_notify over a datagram socket (no dependency); `TimeoutExtender`:
                     EXTEND_TIMEOUT_USEC only after progress.
    _lifecycle.py    rank process groups, parent watch: workers never outlive the daemon.
    _control.py      stop / checkpoint requests as files the ranks poll.
    metrics.py       the metric catalog (names, types, units, buckets, labels).
    _telemetry.py    rank-side recording and snapshot files.
    _throughput.py   per-rank tokens/s, MFU (peak FLOP/s table) and CUDA memory figures.
    _collector.py    node-side aggregation of rank snapshots at scrape time.
    worker.py        rank entry point (elastic agent or plain torchrun).
    _loop.py         the training loop: data -> forward/backward -> step -> metrics -> ckpt.
    job.py           the job seam: `JobSpec`, `JobContext`, `Dataset`, `load_job`.
    _init_from.py    `--init-from` / `JobSpec.init_from`: Hugging Face safetensors (sharded with
                     an index, or one file) checked against the model, then each rank reads
                     only its shards' byte ranges before step 0.
    data.py          `ShardedLoader`: rank-sharded, deterministic, checkpointable position.
    default_job.py   the embedded default job: byte-level GPT on a generated corpus, and the
                     sample of text it writes at the end of a completed run.
    gpt.py           the default job's byte-level GPT and `generate` (also used by tests and
                     benchmarks).
    _logging.py      structlog configuration shared by every process of a run.
    errors.py        the daemon's error tree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from daemon._config_load import load_config
from daemon._logging import LogFormat, bind_process_context, configure_logging
from daemon.config import DaemonConfig

if TYPE_CHECKING:
    from daemon.gpt import GPT, Block, GPTConfig, lm_loss
    from daemon.job import Dataset, JobContext, JobSpec

# [Note: torch is imported lazily] `trainingd --help` / `--version` import this package; the
# names below import torch, so they load on first use (PEP 562) and the console script answers
# at once. A test pins that `daemon.cli` imports no torch.
_LAZY = {
    "GPT": "daemon.gpt",
    "Block": "daemon.gpt",
    "GPTConfig": "daemon.gpt",
    "lm_loss": "daemon.gpt",
    "Dataset": "daemon.job",
    "JobContext": "daemon.job",
    "JobSpec": "daemon.job",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "GPT",
    "Block",
    "DaemonConfig",
    "Dataset",
    "GPTConfig",
    "JobContext",
    "JobSpec",
    "LogFormat",
    "bind_process_context",
    "configure_logging",
    "lm_loss",
    "load_config",
]
