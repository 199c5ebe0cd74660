"""Drives `trainingd run` daemons from outside for the recovery bench: one round is one job on
one topology with one memory setting, trained for a measured stretch, then killed `kills`
times (a rank, or node 1's whole process group replaced by a fresh daemon with an empty memory
directory), then stopped with SIGTERM.

Samples come from rank 0's progress files (`job.py`) and its `restored` log lines (rank 0
lives on node 0, which is never replaced), via `progress.py`.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _recovery import host, job, machine, progress
from _recovery.s3count import CountingS3
from tests.daemon._daemon_proc import DaemonProc, Samples, wait_for
from tests.support.dist import free_port

_JOB = "bench._recovery.job:build"
_START_TIMEOUT_S = 300.0
_RESTART_TIMEOUT_S = 300.0
REPLICA_METRIC_PREFIX = "trainingd_memory_replica_"
"""Peer-replica metrics (issue 29 item 4), found by prefix: their names are not fixed yet."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class RoundSpec:
    """One round's setting."""

    topology: str
    """`1x2` (one node, 2 ranks), `2x1` (two nodes on loopback, 1 rank each) or `1x1` (one
    rank: a core of this 2-core VM left to the daemon and the rank's staging thread)."""
    job_name: str
    """`default` or `big` (the ballast job, `state_mib` per rank, `no_shard`)."""
    memory_every: str
    """`0` (off), `1` or `auto`."""
    failure: str
    """`rank` (SIGKILL one rank) or `node` (SIGKILL node 1's process group, fresh daemon)."""
    kills: int
    measure_steps: int
    """Steps timed before the first kill (after `warmup_steps` steps)."""
    warmup_steps: int = 5
    state_mib: int = 256
    ckpt_every: int = 5
    batch_size: int = 8
    seed: int = 0
    repeat: int = 0
    """Which of the interleaved step-time repetitions (`--step-rounds`) this round is."""
    replica_streams: int = 0
    """`[checkpoint] memory_replica_streams` of the daemons (0: their default)."""
    staging_nice: int | None = None
    """`[checkpoint] staging_nice` of the daemons (None: their default)."""
    rank_start: str = "fork_server"
    """`[launch] rank_start`: `spawn` (a fresh interpreter per rank) with `memory_every 0` is
    the path issue 29 starts from ("today's path")."""

    @property
    def name(self) -> str:
        """`<failure>-<topology>-<job>-mem<memory_every>`, `-spawn` for fresh interpreters,
        `-r<repeat>` after the first."""
        name = f"{self.failure}-{self.topology}-{self.job_name}-mem{self.memory_every}"
        if self.rank_start != "fork_server":
            name += f"-{self.rank_start}"
        return f"{name}-r{self.repeat}" if self.repeat else name


def replica_config_supported() -> bool:
    """Whether this tree's daemon has the peer-replica keys (`[checkpoint]
    memory_replica_address`)."""
    from daemon.config import CheckpointSettings

    return "memory_replica_address" in {f.name for f in dataclasses.fields(CheckpointSettings)}


def _histogram(samples: Samples, name: str) -> dict[float, float]:
    """`{le: cumulative count}` of histogram `name`, summed over its label sets."""
    out: dict[float, float] = {}
    for labels, value in samples.get(f"{name}_bucket", []):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + value
    return out


class _Round:
    """The daemons of one round and what they observed."""

    def __init__(self, spec: RoundSpec, workdir: Path, s3: CountingS3 | None) -> None:
        self.spec, self.s3 = spec, s3
        self.dir = workdir / spec.name
        # One directory per node: after a node is replaced, c10d may give the fresh node's rank
        # global rank 0 (restart 0 of its own agent) while node 0's rank becomes rank 1, so the
        # samples follow node 0's own processes, whatever their global rank.
        self.progress_dir = self.dir / "progress"
        self.progress_dir.mkdir(parents=True)
        self.shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.dir
        self.shm_dirs: list[Path] = []
        self.nodes: list[DaemonProc] = []
        self.replaced: list[DaemonProc] = []
        if s3 is not None:
            bucket = f"recovery-{os.getpid()}-{len(spec.name)}-{int(time.time() * 1000) % 10**8}"
            s3.create_bucket(bucket)
            self.ckpt_uri = f"s3://{bucket}/run"
        else:
            self.ckpt_uri = str(self.dir / "ckpt")
        nnodes, nproc = (int(n) for n in spec.topology.split("x"))
        self.nnodes = nnodes
        strategy = "no_shard" if spec.job_name == "big" else "optim_grads_params"
        self.args = [
            "--nproc-per-node", str(nproc), "--job", _JOB, "--strategy", strategy,
            "--max-steps", "1000000", "--warmup-steps", "2", "--batch-size",
            str(spec.batch_size), "--ckpt-every", str(spec.ckpt_every), "--ckpt-uri",
            self.ckpt_uri, "--memory-every", spec.memory_every, "--max-restarts",
            str(spec.kills + 3), "--seed", str(spec.seed), "--publish-interval-s", "0.5",
        ]  # fmt: skip
        if s3 is not None:
            self.args += ["--s3-endpoint-url", s3.endpoint_url]
        if spec.rank_start != "fork_server":
            self.args += ["--rank-start", spec.rank_start]
        if spec.replica_streams:
            self.args += ["--memory-replica-streams", str(spec.replica_streams)]
        if spec.staging_nice is not None:
            self.args += ["--staging-nice", str(spec.staging_nice)]
        if nnodes > 1:
            endpoint = f"127.0.0.1:{free_port()}"
            self.args += ["--nnodes", str(nnodes), "--rdzv-endpoint", endpoint]
            self.args += ["--rdzv-timeout-s", "300"]

    def _env(self, node_rank: int) -> dict[str, str]:
        shm = Path(
            self.shm_root / f"trainingd-bench-{os.getpid()}-{len(self.shm_dirs)}-{time.time_ns()}"
        )
        self.shm_dirs.append(shm)
        env = {
            job.PROGRESS_DIR_ENV: str(self._node_progress(node_rank)),
            job.STATE_MIB_ENV: str(self.spec.state_mib if self.spec.job_name == "big" else 0),
            "TRAININGD_MEMORY_DIR": str(shm),
        }
        if self.nnodes > 1 and replica_config_supported():
            env["TRAININGD_MEMORY_REPLICA_ADDRESS"] = "127.0.0.1:0"
        return env

    def start_node(self, node_rank: int, name: str) -> DaemonProc:
        args = [*self.args, "--node-rank", str(node_rank)] if self.nnodes > 1 else self.args
        return DaemonProc(self.dir, args, self._env(node_rank), name)

    def _node_progress(self, node_rank: int) -> Path:
        path = self.progress_dir / f"node{node_rank}"
        path.mkdir(exist_ok=True)
        return path

    @property
    def rank(self) -> int | None:
        """The rank whose samples are taken: rank 0 on one node; node 0's only rank on several
        (its global rank may change when node 1 is replaced)."""
        return 0 if self.nnodes == 1 else None

    def incarnations(self) -> list[progress.Incarnation]:
        """Node 0's sampled rank's processes that trained, in the order they started."""
        return progress.read_incarnations(self._node_progress(0), rank=self.rank)

    def alive(self) -> None:
        for d in self.nodes:
            code = d.exit_code()
            if code is not None:
                raise RuntimeError(f"{self.spec.name}: a daemon exited {code}:\n{d.logs()}")

    def wait_started_after(
        self, since_unix: float, count: int, timeout_s: float
    ) -> progress.Incarnation:
        """The first incarnation that started training after `since_unix` and fetched `count`
        batches ([Note: an incarnation is a process, not a restart count] in `progress.py`)."""
        return self._wait_for_incarnation(
            lambda inc: inc.batch_starts[0] > since_unix,
            count,
            timeout_s,
            f"a process started after {since_unix:.3f}",
        )

    def wait_incarnation(self, pid: int, count: int, timeout_s: float) -> progress.Incarnation:
        """Process `pid`'s incarnation once it fetched `count` batches."""
        return self._wait_for_incarnation(
            lambda inc: inc.pid == pid, count, timeout_s, f"pid {pid}"
        )

    def _wait_for_incarnation(
        self,
        match: Callable[[progress.Incarnation], bool],
        count: int,
        timeout_s: float,
        what: str,
    ) -> progress.Incarnation:
        """The first incarnation (in start order) that `match`es once it fetched `count`
        batches; fails if a daemon exits meanwhile."""

        def ready() -> progress.Incarnation | None:
            self.alive()
            return next(
                (i for i in self.incarnations() if match(i) and len(i.batch_starts) >= count),
                None,
            )

        found: progress.Incarnation = wait_for(ready, timeout_s, f"{self.spec.name}: {what}")
        return found

    def incarnation(self, pid: int) -> progress.Incarnation | None:
        """Process `pid`'s incarnation as it is now (None: it wrote no batch)."""
        return next((inc for inc in self.incarnations() if inc.pid == pid), None)

    def slot_bytes(self) -> int:
        """Size of one local slot file (the rank's whole state in the memory tier), 0: none."""
        # The largest match: the slot itself, not its small meta file beside it.
        sizes = [p.stat().st_size for shm in self.shm_dirs for p in shm.rglob("rank-*.slot-*")]
        return max(sizes, default=0)

    def cleanup(self) -> None:
        for d in [*self.nodes, *self.replaced]:
            d.cleanup()
        for shm in self.shm_dirs:
            shutil.rmtree(shm, ignore_errors=True)


def run_round(spec: RoundSpec, workdir: Path, rng: random.Random, s3: CountingS3 | None) -> dict:
    """Run one round; its samples and observations as a JSON-ready dict."""
    r = _Round(spec, workdir, s3)
    out: dict[str, Any] = {"spec": dataclasses.asdict(spec), "kills": []}
    started = time.monotonic()
    try:
        r.nodes = [r.start_node(k, f"node{k}") for k in range(r.nnodes)]
        # The stall histogram of the warm-up (its first snapshots allocate the slot files, a
        # cost each rank process pays once), apart from the measured stretch's: the ranks
        # publish it every `--publish-interval-s` (0.5 s), so it is read a second after.
        first = r.wait_started_after(0.0, spec.warmup_steps + 1, _START_TIMEOUT_S)
        probe = host.StretchProbe(pid for d in r.nodes for pid in d.rank_pids())
        time.sleep(1.0)
        warmup = _stall_buckets(r.nodes)
        first = r.wait_incarnation(
            first.pid, spec.warmup_steps + spec.measure_steps + 1, _START_TIMEOUT_S
        )
        out["step_times_s"] = progress.step_times(first, skip=spec.warmup_steps)[
            : spec.measure_steps
        ]
        out["stretch_host"] = probe.end()
        whole = _stall_buckets(r.nodes)
        out["snapshot_seconds_buckets"] = {
            le: count - warmup.get(le, 0.0) for le, count in whole.items()
        }
        out["snapshot_seconds_buckets_warmup"] = warmup
        out["state_bytes_per_rank"] = r.slot_bytes()
        if r.nnodes > 1 and spec.memory_every != "0" and out["state_bytes_per_rank"]:
            # The plain loopback copy again, while this round trains: the same load the
            # replicas stream under (the run's reference is taken with nothing running).
            out["loopback_under_load_bytes_per_s"] = machine.loopback_tcp_bytes_per_s(
                out["state_bytes_per_rank"]
            )
        for restart in range(1, spec.kills + 1):
            before = r.incarnations()[-1]  # the newest process: the one training now
            before_start = _start_step(r.nodes[0].events(), before, r.rank)
            # A random point of training: 0.5-3 step times after the group trains again.
            step_s = max(progress.step_times(before, skip=0)[-3:] or [0.2])
            time.sleep(rng.uniform(0.5, 3.0) * step_s)
            ended_pids = {pid for d in r.nodes for pid in d.rank_pids()}  # the group the kill ends
            killed = time.time()
            if spec.failure == "rank":
                pids = [pid for d in r.nodes for pid in d.rank_pids()]
                os.kill(rng.choice(pids), signal.SIGKILL)
            else:
                lost = r.nodes[1]
                lost.cleanup()  # SIGKILLs its process group; unlinks the daemon's semaphores
                r.replaced.append(lost)
                r.nodes[1] = r.start_node(1, f"node1-{restart}")
            after = r.wait_started_after(killed, 2, _RESTART_TIMEOUT_S)
            before = r.incarnation(before.pid) or before  # lines written after the kill count too
            restored = progress.restored_event(r.nodes[0].events(), r.rank, after)
            restored_step = int(restored["ckpt_step"]) if restored is not None else 0
            catchup = progress.lines_to_catch_up(before, before_start, restored_step)
            after = r.wait_incarnation(after.pid, max(catchup, 2), _RESTART_TIMEOUT_S)
            sample = progress.kill_sample(killed, before, before_start, after, restored)
            row = sample._asdict()
            if s3 is not None:
                window = s3.object_reads(killed, after.batch_starts[1])
                # Counted apart: the status page's listing of new checkpoints (on its own
                # timer, restore or not), and the reads of the rank group the kill ended while
                # it winds down (its retention pass, say: named by the rank's pid in its
                # User-Agent). Everything else counts: the restarted ranks', a fresh daemon's
                # start-up checks, an unnamed client's.
                listing = [x for x in window if x.component == "trainingd-status"]
                ended = [
                    x for x in window if x.component == "trainingd-rank" and x.pid in ended_pids
                ]
                reads = [x for x in window if x not in listing and x not in ended]
                row["storage_bytes_read"] = sum(x.num_bytes for x in reads)
                row["storage_objects_read"] = len(reads)
                row["status_page_bytes_read"] = sum(x.num_bytes for x in listing)
                row["ended_group_bytes_read"] = sum(x.num_bytes for x in ended)
                # Which objects (key without the bucket, bytes, component, seconds after the
                # kill): what is still read, and by whom.
                row["storage_reads"] = [
                    [
                        x.key.split("/", 1)[-1],
                        x.num_bytes,
                        x.component,
                        x.pid,
                        round(x.done_unix - killed, 3),
                    ]
                    for x in window
                ]
            out["kills"].append(row)
            print(
                f"{spec.name}: kill {restart}: lost {sample.steps_lost}, "
                f"{sample.recovery_s:.2f} s, from {sample.source}",
                file=sys.stderr,
            )
        out["replica_metrics"] = _replica_metrics(r.nodes)
        for d in r.nodes:
            d.signal(signal.SIGTERM)
        out["exit_codes"] = [d.wait(300) for d in r.nodes]
    finally:
        r.cleanup()
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


def _start_step(
    events: list[dict[str, Any]], incarnation: progress.Incarnation, rank: int | None
) -> int:
    restored = progress.restored_event(events, rank, incarnation)
    return int(restored["ckpt_step"]) if restored is not None else 0


def _stall_buckets(nodes: list[DaemonProc]) -> dict[str, float]:
    """The snapshot-stall histogram of every node, summed (`{le: count}`, le as text)."""
    total: dict[float, float] = {}
    for d in nodes:
        for le, count in _histogram(d.scrape(), "trainingd_memory_snapshot_seconds").items():
            total[le] = total.get(le, 0.0) + count
    return {str(le): count for le, count in sorted(total.items())}


def _replica_metrics(nodes: list[DaemonProc]) -> dict[str, float]:
    """Every sample whose name starts with `REPLICA_METRIC_PREFIX`, summed over nodes/labels."""
    out: dict[str, float] = {}
    for d in nodes:
        for name, series in d.scrape().items():
            if name.startswith(REPLICA_METRIC_PREFIX) and not name.endswith("_created"):
                out[name] = out.get(name, 0.0) + sum(v for _, v in series)
    return out
