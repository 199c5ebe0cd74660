"""trainingd's per-node service: launches local ranks, trains, checkpoints, exports metrics.

`daemon` composes the two engines (`sharding`, `ckpt_manager`) and is the only package that
knows Prometheus, systemd and the elastic launcher. This import name is ours: trainingd never
depends on the unrelated `python-daemon` distribution (a test pins that `daemon` resolves here).

A node runs two kinds of process, and the folders follow them: one daemon process (`agent/`,
reporting through `observe/`) and one rank process per local rank (`rank/`). They share no
memory and never call each other; they talk through files in the run directory (`rundir/`).

    daemon/
      __init__.py        the public names (`JobSpec`, `GPT`, `DaemonConfig`, ...).
      cli.py             `trainingd` console script (`run`, `config show`): the daemon process's
                         entry, which hands the agent the rank entry point.
      worker.py          the rank process's entry: `elastic_entry` (what the elastic agent runs
                         in every rank) and `python -m daemon.worker` (plain torchrun).
      default_job.py     `--job daemon.default_job:build`, the default job's documented name.
      config.py          frozen per-component settings (`DaemonConfig` and its four sections).
      _config_load.py    TOML + `TRAININGD_*` + flags -> `DaemonConfig`; precedence, messages.
      _logging.py        structlog configuration shared by every process of a run.
      errors.py          the daemon's error tree.
      _version.py        the installed distribution's version.
      metrics.py         the metric catalog (names, types, units, buckets, labels, scopes):
                         ranks record into it, the daemon's collector exports it.
      _device.py         `device` auto|cpu|cuda -> this rank's torch device and collective
                         backend; the start-up check of the setting.
      _lifecycle.py      process groups: ranks never outlive the daemon, their writers never
                         outlive them (the rank leads its group, the daemon kills dead groups).
      _storage.py        the checkpoint root's fsspec options from the config.
      rundir/            the run directory, the only channel between the two processes:
        control.py       stop / checkpoint requests (daemon writes, ranks poll).
        snapshot.py      the rank snapshot file (ranks write, the daemon reads).
        progress.py      the rank's progress word: step and phase (ranks write, daemon reads).
        stacks.py        the ranks' stack dumps on SIGUSR2 and their parsing (hang detection).
        failure.py       the rank error file: exception, step, phase, traceback tail (ranks
                         write it when they fail, the daemon classifies the failure).
      jobs/              what is trained (both processes import it):
        job.py           the job seam: `JobSpec`, `JobContext`, `Dataset`, `load_job`.
        default_job.py   the embedded default job: byte-level GPT on a generated corpus, and
                         the sample of text it writes at the end of a completed run.
        gpt.py           the default job's byte-level GPT and `generate`.
        init_from.py     `--init-from` / `JobSpec.init_from`: safetensors checked against the
                         model, each rank reading only its shards' byte ranges.
        model_files.py   the init source's `config.json` etc., saved with every step.
      agent/             the daemon process:
        run.py           `trainingd run` from start-up checks to exit code.
        preflight.py     start-up checks -> exit 2.
        root_checks.py   the root's checks of a multi-node job's node: first round only.
        memory_dir.py    the node's memory-tier directory in tmpfs: claimed at start (a live
                         owner refused, a killed one's reclaimed), removed at every exit.
        semaphores.py    the named semaphores torch made for the ranks, recorded there for a
                         successor to unlink after a group SIGKILL.
        memory_budget.py the tier's start-up budget: tmpfs, cgroup, estimated need -> one line;
                         exit 2 (explicit memory_every) or durable-only (auto) when unfit.
        elastic.py       the elastic agent in membership rounds: shrink and grow (`MIN:MAX`).
        store_guard.py   rendezvous-store outages ridden out within a grace, then exit 75.
        rdzv_delegate.py the rendezvous-handler pass-through the agent's wrappers build on.
        rdzv_poll.py     a waiting node reads the rendezvous every max_nodes x 20 ms, not 1 s.
        fork_server.py   warm rank starts: ranks fork from a server that imported torch and
                         the job once (never CUDA, no threads), checked on a first fork.
        _server_state.py runs in that server: its CUDA state after its imports.
        supervisor.py    supervisor thread: phase/readiness, sd_notify, orphan reaping, progress.
        hang.py          hang detection: a rank without progress named, its group restarted.
        failures.py      rank failures classified, counted, shown; deterministic ones and the
                         job's own before training end the run (exit 1 / exit 2).
        scrapes.py       when `/metrics` was read; the wait for one read of a finished run.
        straggler.py     the straggler watch: a rank slower than its peers named.
        incident_watch.py rank failures as incidents; restarts seen through to their first step.
        http.py          one port: `/`, `/api/status`, `/metrics`, `/healthz`, `/readyz`.
        scrapes.py       scrapes of `/metrics`; the wait for one read of a finished run.
        status_page.py   the status page's HTML.
        progress.py      the live status line on a terminal, `progress` log events off it.
        relay.py         on a terminal: the ranks' output, printed by the daemon.
        notify.py        sd_notify; `TimeoutExtender`: EXTEND_TIMEOUT_USEC only after progress.
        replica/         peer replicas of the memory tier (node ring, [Note: the replica ring]):
          protocol.py    the wire format: JSON frames, raw payloads, a commit trailer.
          holdings.py    the replicas held here: 2 slots per remote rank, rounds per sender.
          server.py      receive (refusals, verify, then the meta) and serve a fetch.
          sender.py      stream the local ranks' newest complete snapshots to the next node.
          watch.py       wake the sender when a meta is renamed into the tier (inotify).
          stripes.py     a large payload striped over `memory_replica_streams` connections.
          fetch.py       after a node loss: copy its snapshots back before its ranks start.
          peers.py       the round number and every node's address (rendezvous store).
          stats.py       bytes, seconds, failures by reason, lag: the replica metrics.
          service.py     `ReplicaService`: the above, driven by the agent's rounds.
      observe/           what the daemon process knows about its node and reports:
        state.py         `NodeState` / `NodePhase`: the node's lifecycle.
        collector.py     rank snapshots read at scrape time; the Prometheus collector.
        status.py        `StatusBoard`: the status page's and `/api/status`'s data.
        hangs.py         `HangLedger`: declared hangs for `/metrics` and the status page.
        stragglers.py    `StragglerLedger`: named stragglers for `/metrics` and the status page.
        incidents.py     `IncidentLog`: one story per fault, `<run_dir>/incidents.jsonl`.
        report.py        `trainingd status`: a daemon's status (or run directory) summarized.
      data/              token datasets (used by the ranks and by jobs):
        token_file.py    the `.bin` + JSON sidecar format; `write_token_file`, `read_info`.
        reader.py        `BlockCache`: range reads through a bounded LRU of aligned blocks.
        dataset.py       `TokenDataset`: seq_len + 1 token samples, files mixed by weight.
        prepare.py       `trainingd prepare-data`: text files to a token file.
      rank/              the rank process:
        loop.py          the training loop: data -> forward/backward -> step -> metrics -> ckpt.
        data.py          `ShardedLoader`: rank-sharded, deterministic, checkpointable position.
        batch.py         a micro-batch (`(inputs, targets)` or a dict for `model(**batch)`).
        prefetch.py      `PrefetchingLoader`: the next batches read on a background thread.
        token_data.py    `--data` / `--val-data`: the job trains (validates) on token files.
        evaluation.py    the validation loss every `eval_every` steps, averaged over ranks.
        permutation.py   `FeistelPermutation`: a seeded order of [0, n) in O(1) memory.
        telemetry.py     rank-side metric recording, published as the rank's snapshot.
        phase_watch.py   a checkpoint call that lasts is published as `checkpointing`.
        throughput.py    per-rank tokens/s, MFU (peak FLOP/s table) and CUDA memory figures.
        save_failures.py the save failure policy: report, keep training, give up after N.
        deferral.py      durable saves deferred while an earlier write is in flight, then owed.
        memory_cadence.py when the memory tier snapshots: fixed, or `auto` (within 2% of
                         the step time, adaptive).
        stragglers.py    compute time per step on the per-step agreement; straggler scores.

Layering (who may import whom; every import counts, `tests/daemon/test_layering.py` checks it):
    shared modules   (config, _config_load, _logging, errors, _version, metrics, _device,
                     _lifecycle, _storage): only each other.
    rundir/, jobs/,  shared modules only.
    data/
    rank/, worker    shared, rundir/, jobs/, data/; never agent/ or observe/.
    observe/         shared, rundir/; never rank/ or agent/.
    agent/           shared, rundir/, jobs/, observe/; never rank/ or worker.
    cli              shared, agent/, worker, data/ (`prepare-data`): the one place both sides
                     meet, to hand the agent its rank entry point.
So the two processes depend only on what they share: the run directory's files, the metric
catalog, the config and the job (CONTRACTS.md, "The daemon and its ranks").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from daemon._config_load import load_config
from daemon._logging import LogFormat, bind_process_context, configure_logging
from daemon.config import DaemonConfig

if TYPE_CHECKING:
    from daemon.jobs.gpt import GPT, Block, GPTConfig, lm_loss
    from daemon.jobs.job import Dataset, JobContext, JobSpec

# [Note: torch is imported lazily] `trainingd --help` / `--version` import this package; the
# names below import torch, so they load on first use (PEP 562) and the console script answers
# at once. A test pins that `daemon.cli` imports no torch.
_LAZY = {
    "GPT": "daemon.jobs.gpt",
    "Block": "daemon.jobs.gpt",
    "GPTConfig": "daemon.jobs.gpt",
    "lm_loss": "daemon.jobs.gpt",
    "Dataset": "daemon.jobs.job",
    "JobContext": "daemon.jobs.job",
    "JobSpec": "daemon.jobs.job",
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
