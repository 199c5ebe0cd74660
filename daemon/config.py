"""The daemon's configuration: frozen dataclasses, one per component, and nothing else.

`DaemonConfig` groups four sections, which are also the tables of the TOML file:
`[launch]` (`LaunchSettings`), `[train]` (`TrainSettings`), `[checkpoint]`
(`CheckpointSettings`) and `[observability]` (`ObservabilitySettings`). Key names are unique
across sections, so each key also has a flag (`max_steps` -> `--max-steps`) and an environment
variable (`TRAININGD_MAX_STEPS`). Loading, precedence and error messages live in
`daemon/_config_load.py`; this module only declares and validates. The `[checkpoint]` keys
`keep_*` are not declared here: they are ckpt_manager's retention keys (one per parameter of
each registered policy), held in `CheckpointSettings.retention`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import re
import typing
from pathlib import Path

from ckpt_manager import AsyncMode
from ckpt_manager.retention import RetentionOptions
from daemon._logging import LogFormat

__all__ = [
    "CheckpointSettings",
    "DaemonConfig",
    "Device",
    "LaunchSettings",
    "ObservabilitySettings",
    "Precision",
    "RankStart",
    "RdzvBackend",
    "StepInterval",
    "StragglerAction",
    "StrategyName",
    "TimeoutSeconds",
    "TrainSettings",
]


class StrategyName(enum.StrEnum):
    """The names `strategy` accepts: the four of `sharding.Strategy`, and `hybrid`.

    Not `sharding.Strategy` itself, for two reasons: `hybrid` is no engine strategy but ZeRO-3
    with a shard group size (see `DaemonConfig.shard_group_size_at`), and importing `sharding`
    imports torch, which the configuration must not (`trainingd --help` and `config show` answer
    without it). The rank turns a name into the engine's enum with `engine_strategy`; a test
    pins that the names are the engine's values plus `hybrid`.
    """

    NO_SHARD = "no_shard"
    """Replicated weights, all-reduced gradients (DDP)."""
    OPTIM = "optim"
    """Sharded optimizer state (ZeRO-1)."""
    OPTIM_GRADS = "optim_grads"
    """Sharded optimizer state and gradients (ZeRO-2)."""
    OPTIM_GRADS_PARAMS = "optim_grads_params"
    """Everything sharded (ZeRO-3); on more than one node sharded within each node and
    replicated across nodes unless `shard_group_size` says otherwise."""
    HYBRID = "hybrid"
    """ZeRO-3 sharded within groups of `shard_group_size` ranks (default: the node's ranks),
    replicated across the groups (HSDP), at any node count."""

    @property
    def engine_strategy(self) -> str:
        """The value of the `sharding.Strategy` this name runs (`hybrid` is ZeRO-3)."""
        return StrategyName.OPTIM_GRADS_PARAMS.value if self is StrategyName.HYBRID else self.value


class Precision(enum.StrEnum):
    """Dtypes the daemon's model may compute or reduce gradients in (`torch.<value>`).

    float16 is not offered: it needs loss scaling (`sharding.DynamicLossScale`), and the
    daemon's loop calls `loss.backward()` on the unscaled loss.
    """

    FLOAT32 = "float32"
    """Full precision."""
    BFLOAT16 = "bfloat16"
    """bf16: fp32's exponent range, half the bytes; main weights stay fp32."""


class Device(enum.StrEnum):
    """Where each rank trains (`daemon/_device.py` resolves it on the node)."""

    AUTO = "auto"
    """CUDA when this node has it (rank `r` on GPU `local_rank`), else the CPU."""
    CPU = "cpu"
    """The CPU, gloo collectives."""
    CUDA = "cuda"
    """GPU `local_rank`, NCCL collectives; start-up fails when the node has no CUDA."""


class RankStart(enum.StrEnum):
    """How the daemon starts its rank processes (`daemon/agent/fork_server.py`)."""

    FORK_SERVER = "fork_server"
    """Forked from a server the daemon starts once, which has imported torch, trainingd and
    the job (no CUDA, no threads): a start or restart skips seconds of imports."""
    SPAWN = "spawn"
    """A fresh interpreter per rank (multiprocessing's spawn), each importing everything."""


class RdzvBackend(enum.StrEnum):
    """Where the job's rendezvous lives (torch elastic's backends of the same names).

    [Note: which rendezvous backend] `c10d` needs nothing outside trainingd: node 0's daemon
    hosts the store, so the job lives only as long as node 0 does (a fixed `--nnodes N` job
    restarts everything anyway; an elastic `MIN:MAX` job cannot go on without node 0). `etcd-v2`
    keeps the rendezvous in an etcd server (v2 API) that outlives every node: an elastic job goes
    on with the surviving nodes whichever node is lost, node 0 included, and takes a replacement
    back. It costs one more service to run (a small StatefulSet, `deploy/kubernetes/etcd/`).
    """

    C10D = "c10d"
    """A TCP store hosted by node 0's daemon at `rdzv_endpoint`."""
    ETCD_V2 = "etcd-v2"
    """An external etcd server (v2 API, `--enable-v2=true`) at `rdzv_endpoint`; no node is
    special. Needs the `python-etcd` package (`pip install 'trainingd[etcd]'`)."""


@dataclasses.dataclass(frozen=True)
class StepInterval:
    """A number of steps, or `auto`: chosen while the run goes (`memory_every`).

    Written `auto` or a whole number (`0` turns the thing off) in TOML, flags and variables;
    `parse` reads any of them and `str()` writes it back.
    """

    steps: int | None = None
    """The interval in steps; None is `auto`."""

    ALLOWED: typing.ClassVar[str] = "auto, or a whole number of steps (0 or more; 0: off)"
    """What `parse` accepts, for error messages."""

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or (self.steps is not None and self.steps < 0):
            raise ValueError(f"step interval {self.steps!r}: use {self.ALLOWED}")

    @classmethod
    def parse(cls, raw: object) -> StepInterval:
        """`auto` (any case), or an integer (an int, or its decimal text) of 0 or more.

        Raises:
            ValueError: anything else (a float, a bool, a negative number, other text).
        """
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return cls(None)
        if isinstance(raw, bool | float):
            raise ValueError(f"step interval {raw!r}: use {cls.ALLOWED}")
        try:
            steps = int(str(raw).strip(), 10)
        except ValueError:
            raise ValueError(f"step interval {raw!r}: use {cls.ALLOWED}") from None
        return cls(steps)

    @property
    def is_auto(self) -> bool:
        """Whether the interval is chosen at run time."""
        return self.steps is None

    @property
    def is_off(self) -> bool:
        """Whether the interval is 0 (the thing never runs)."""
        return self.steps == 0

    def __str__(self) -> str:
        return "auto" if self.steps is None else str(self.steps)


@dataclasses.dataclass(frozen=True)
class TimeoutSeconds:
    """A timeout in seconds, or `auto`: derived while the run goes (`hang_timeout_s`).

    Written `auto` or a number of seconds in TOML, flags and variables (`0` is an alias of
    `auto`, and reads back as it); `parse` reads any of them and `str()` writes it back.
    """

    seconds: float | None = None
    """The timeout; None is `auto`."""

    ALLOWED: typing.ClassVar[str] = "auto, or a number of seconds > 0 (0 is auto too)"
    """What `parse` accepts, for error messages."""

    def __post_init__(self) -> None:
        value = self.seconds
        if isinstance(value, bool) or (
            value is not None and not (isinstance(value, int | float) and 0 <= value < math.inf)
        ):
            raise ValueError(f"timeout {value!r}: use {self.ALLOWED}")
        # 0 is `auto` (the older spelling): one value, whichever way it was written.
        object.__setattr__(self, "seconds", float(value) if value else None)

    @classmethod
    def parse(cls, raw: object) -> TimeoutSeconds:
        """`auto` (any case), or a number of seconds (a number, or its text) of 0 or more.

        Raises:
            ValueError: anything else (a bool, a negative or infinite number, other text).
        """
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return cls(None)
        if isinstance(raw, bool):
            raise ValueError(f"timeout {raw!r}: use {cls.ALLOWED}")
        try:
            seconds = float(str(raw).strip())
        except ValueError:
            raise ValueError(f"timeout {raw!r}: use {cls.ALLOWED}") from None
        if math.isnan(seconds):
            raise ValueError(f"timeout {raw!r}: use {cls.ALLOWED}")
        return cls(seconds)

    @property
    def is_auto(self) -> bool:
        """Whether the timeout is derived at run time."""
        return self.seconds is None

    def __str__(self) -> str:
        return "auto" if self.seconds is None else repr(self.seconds)


_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")
_JOB = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_JOB_FILE = re.compile(r"^[^:]*(\.py|/[^/:]+):[A-Za-z_]\w*$")  # path/to/job.py:callable
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value <= 0:
            raise ValueError(f"{name}={value}: use a positive number")


def _non_negative(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < 0:
            raise ValueError(f"{name}={value}: use 0 or more")


@dataclasses.dataclass(kw_only=True, frozen=True)
class LaunchSettings:
    """How this node joins the job: local ranks, rendezvous, restarts, shutdown."""

    nproc_per_node: int = 2
    """Rank processes started on this node."""
    nnodes: str = "1"
    """Nodes in the job: `N`, or `MIN:MAX` (torchrun's syntax) for an elastic job that goes on
    with fewer nodes when one leaves (down to MIN) and grows again when it returns (up to MAX)."""
    node_rank: int = 0
    """This node's index; with `rdzv_backend = "c10d"` node 0 hosts the rendezvous store at
    `rdzv_endpoint`."""
    rdzv_backend: RdzvBackend = RdzvBackend.C10D
    """`c10d`: node 0's daemon hosts the rendezvous; `etcd-v2`: an etcd server at
    `rdzv_endpoint` does, and the job outlives any node (README, "Rendezvous: c10d or etcd")."""
    rdzv_endpoint: str = ""
    """`host:port` of the rendezvous: node 0's (c10d) or the etcd server's (etcd-v2); empty
    runs a single c10d node on a free loopback port."""
    rdzv_id: str = ""
    """Rendezvous id shared by all nodes of the job; empty uses the run id."""
    rdzv_timeout_s: int = 300
    """How long to wait for all nodes to join."""
    rdzv_last_call_s: int = 30
    """Elastic `MIN:MAX` only: once MIN nodes are in a rendezvous, how long it waits for more
    before the job goes on without them (torch's `last_call_timeout`)."""
    rdzv_store_timeout_s: int = 60
    """How long one call to the rendezvous store waits for its answer (torch's `read_timeout`);
    a call that times out starts a store outage (`rdzv_store_grace_s`)."""
    rdzv_store_grace_s: float = 120.0
    """How long an unreachable rendezvous store (its host paused, a network blip) is ridden
    out while the ranks keep training; past it, this node stops with exit 75 (README, "Store
    outages")."""
    max_restarts: int = 3
    """Worker-group restarts the elastic agent may do before the run fails."""
    rank_start: RankStart = RankStart.FORK_SERVER
    """`fork_server`: ranks fork from a server that imported torch, trainingd and the job once
    (falls back to `spawn`, with a warning, if that server is not safe to fork); `spawn`: a
    fresh interpreter per rank."""
    shutdown_timeout_s: float = 300.0
    """After SIGTERM: time granted to finish the step, save and finalize before workers are
    killed (keep it under systemd's TimeoutStopSec and Kubernetes' grace period)."""
    run_id: str = ""
    """Name of the run (checkpoints, logs); empty derives it from the job and checkpoint root,
    so restarting the same job resumes the same run."""
    run_dir: str = ""
    """Per-run scratch directory for rank snapshots and control files; empty uses
    `$RUNTIME_DIRECTORY` or the system temp directory."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "nproc_per_node",
            "rdzv_timeout_s",
            "rdzv_last_call_s",
            "rdzv_store_timeout_s",
            "rdzv_store_grace_s",
            "shutdown_timeout_s",
        )
        _non_negative(self, "node_rank", "max_restarts")
        match = _NNODES.match(self.nnodes)
        if match is None:
            raise ValueError(f"nnodes={self.nnodes!r}: use N or MIN:MAX, e.g. 2 or 1:4")
        lo, hi = self.min_nodes, self.max_nodes
        if lo < 1 or hi < lo:
            raise ValueError(f"nnodes={self.nnodes!r}: need 1 <= MIN <= MAX")
        if self.node_rank >= hi:
            raise ValueError(f"node_rank={self.node_rank}: must be below nnodes ({hi})")
        etcd = self.rdzv_backend is RdzvBackend.ETCD_V2
        if etcd and not self.rdzv_endpoint:
            raise ValueError(
                "rdzv_endpoint is empty: rdzv_backend=etcd-v2 needs the etcd "
                "server's host:port, e.g. etcd:2379"
            )
        if hi > 1 and not self.rdzv_endpoint:
            raise ValueError("rdzv_endpoint is empty: several nodes need host:port of node 0")
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise ValueError(f"rdzv_endpoint={self.rdzv_endpoint!r}: use host:port")
        if self.run_id and not _RUN_ID.match(self.run_id):
            raise ValueError(f"run_id={self.run_id!r}: use letters, digits, '_', '.', '-'")

    @property
    def min_nodes(self) -> int:
        """Lower bound of `nnodes`."""
        match = _NNODES.match(self.nnodes)
        assert match is not None
        return int(match.group(1))

    @property
    def max_nodes(self) -> int:
        """Upper bound of `nnodes`."""
        match = _NNODES.match(self.nnodes)
        assert match is not None
        return int(match.group(2) or match.group(1))

    @property
    def elastic(self) -> bool:
        """Whether the node count may change while the job runs (`MIN:MAX` with MIN < MAX)."""
        return self.min_nodes < self.max_nodes


def _check_data(data: str, data_weights: str) -> None:
    """`data` / `data_weights`: one positive weight per file, weights only with files."""
    if not data_weights:
        return
    if not data:
        raise ValueError("data_weights without data: name the token files with data=...")
    files = [f for f in data.split(",") if f.strip()]
    try:
        weights = [float(w) for w in data_weights.split(",")]
    except ValueError:
        raise ValueError(
            f"data_weights={data_weights!r}: use comma-separated numbers, e.g. 0.7,0.3"
        ) from None
    if len(weights) != len(files) or any(not w > 0 for w in weights):
        raise ValueError(
            f"data_weights={data_weights!r}: give one weight > 0 per data file ({len(files)})"
        )


@dataclasses.dataclass(kw_only=True, frozen=True)
class TrainSettings:
    """What each rank trains and how."""

    job: str = "daemon.default_job:build"
    """`module:callable` (a module importable from the current directory or `sys.path`) or
    `path/to/job.py:callable`, returning a `daemon.JobSpec` (model, datasets, loss)."""
    init_from: str = ""
    """Safetensors weights to start from before step 0 when no checkpoint exists: a
    directory with `model.safetensors.index.json` or `model.safetensors`, or one file; path
    or `s3://`; overrides the job's `init_from`; empty: none."""
    data: str = ""
    """Token files to train on instead of the job's `train_data`: comma-separated `.bin`
    paths or fsspec URIs (`s3://...`), each with its `.json` sidecar (`trainingd
    prepare-data`); samples are the job's `tokens_per_sample` + 1 tokens; empty: the job's."""
    data_weights: str = ""
    """Comma-separated mixture weights, one per `data` file (a file drawn more often than its
    size repeats); empty: the files are concatenated, each sample once per epoch."""
    data_prefetch: int = 2
    """Micro-batches each rank reads ahead on a background thread, so reading (S3 range
    reads) is off the step's path; 0 reads on the training thread."""
    val_data: str = ""
    """Token files to validate on instead of the job's `val_data`: comma-separated `.bin`
    paths or fsspec URIs, as `data`; empty: the job's (if any)."""
    eval_every: int = 0
    """Evaluate the validation loss every this many steps and at `max_steps` (needs
    `val_data` or a job's `val_data`); 0: never."""
    eval_batches: int = 4
    """Micro-batches of `batch_size` each rank evaluates: the same ones every evaluation (the
    first `eval_batches x batch_size x world size` validation samples; with `nnodes` MIN:MAX,
    at MAX nodes: fewer nodes evaluate more per rank, so the set stays the same)."""
    max_steps: int = 300
    """Optimizer steps of the whole run (a resumed run continues up to it)."""
    strategy: StrategyName = StrategyName.OPTIM_GRADS_PARAMS
    """Sharding strategy: `no_shard`, `optim`, `optim_grads`, `optim_grads_params` (ZeRO-3)
    or `hybrid` (ZeRO-3 sharded within each node, replicated across nodes)."""
    param_dtype: Precision = Precision.FLOAT32
    """Compute dtype of the model (`float32` or `bfloat16`; float inputs are cast to it, the
    logits handed to the loss are fp32, main weights and optimizer state stay fp32)."""
    fp32_modules: str = ""
    """Comma-separated class names of modules kept in fp32 under a lower `param_dtype` (their
    parameters and buffers; e.g. `LlamaRMSNorm`); each must name a class in the model; empty:
    BatchNorm only."""
    reduce_dtype: Precision = Precision.FLOAT32
    """Dtype of the gradient reduce-scatter / all-reduce (`bfloat16` halves its bytes;
    gradients still accumulate in fp32)."""
    batch_size: int = 8
    """Sequences per micro-batch per rank."""
    micro_batches: int = 1
    """Micro-batches accumulated per optimizer step; with `nnodes` MIN:MAX, at MAX nodes (fewer
    nodes accumulate more, so the global batch stays the same)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear warm-up steps, then cosine decay to 10% of `lr` at `max_steps`."""
    weight_decay: float = 0.1
    """AdamW weight decay of weight matrices; biases, norm weights and embeddings get none."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    seed: int = 0
    """Seed of model init, data order and RNG streams."""
    threads_per_rank: int = 1
    """`torch.set_num_threads` in each rank."""
    device: Device = Device.AUTO
    """`auto`, `cpu` or `cuda`: CUDA runs each rank on GPU `local_rank` with NCCL for training
    collectives (`nproc_per_node` at most the GPU count)."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device, the denominator of `trainingd_train_mfu_ratio`; 0 looks the
    GPU up in a built-in table of bf16 dense peaks (the CPU has no entry: no MFU exported)."""
    max_inflight_reductions: int = 2
    """Gradient reductions in flight per rank before backward waits for the oldest (the
    sharding engine's bound; its queue depth per step is exported against it)."""
    shard_group_size: int = 0
    """Ranks one copy of the sharded state spans (hybrid sharding: replicated across the
    groups); 0 picks `nproc_per_node` for `hybrid`, and for `optim_grads_params` on more than
    one node of several ranks, else the whole world. Must divide the world size; not with
    `no_shard`."""

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "micro_batches", "lr", "threads_per_rank")
        _non_negative(self, "shard_group_size", "data_prefetch", "eval_every")
        _positive(self, "eval_batches")
        if self.shard_group_size and self.strategy is StrategyName.NO_SHARD:
            raise ValueError(
                f"shard_group_size={self.shard_group_size} with strategy=no_shard: no_shard "
                "replicates everything; use strategy=hybrid (or optim_grads_params) or "
                "shard_group_size=0"
            )
        if self.max_inflight_reductions < 1:
            raise ValueError(
                f"max_inflight_reductions={self.max_inflight_reductions}: use 1 or more "
                "(1 waits for each reduction before issuing the next)"
            )
        _non_negative(
            self, "max_steps", "warmup_steps", "weight_decay", "grad_clip", "seed", "peak_flops"
        )
        _check_data(self.data, self.data_weights)
        if not _JOB.match(self.job) and not _JOB_FILE.match(self.job):
            raise ValueError(
                f"job={self.job!r}: use module:callable or path/to/job.py:callable, e.g. "
                "mypkg.jobs:build"
            )


@dataclasses.dataclass(kw_only=True, frozen=True)
class CheckpointSettings:
    """Where and how often checkpoints are written, and which are kept."""

    ckpt_uri: str = "./trainingd-checkpoints"
    """Checkpoint root: a local path, `file://`, or `s3://bucket/prefix`."""
    ckpt_every: int = 50
    """Save every this many steps (plus a final save on stop); 0 saves only on stop."""
    retention: RetentionOptions = dataclasses.field(default_factory=RetentionOptions)
    """Which committed checkpoints are kept: the `keep_*` keys, one per parameter of each
    retention policy of `ckpt_manager` (`ckpt_manager.retention.config_keys()`: `keep_last`,
    `keep_every`, `keep_interval_s`, `keep_best` with `keep_best_metric` and
    `keep_best_mode`), combined by union; checked when built."""
    async_mode: AsyncMode = AsyncMode.PERSISTENT
    """Writer mode."""
    s3_endpoint_url: str = ""
    """S3 endpoint for `s3://` roots (MinIO, SeaweedFS, moto); empty uses AWS or
    `$AWS_ENDPOINT_URL`. Credentials come from the usual AWS variables."""
    s3_spread_prefixes: int = 16
    """Sub-prefixes each step's rank files are spread over on `s3://` roots, so a large
    save stays under S3's per-prefix request rate (0: plain names; at most 256). Other roots
    always use plain names."""
    max_consecutive_save_failures: int = 3
    """Failed saves in a row that stop the run; each earlier one is logged, counted and
    alerted on while training goes on. 1 stops the run at the first failed save."""
    memory_every: StepInterval = StepInterval()
    """Steps between two snapshots of each rank's whole state into node memory, held by the
    daemon so a rank restart resumes from it: `auto` picks the smallest interval costing at most
    2% of the step time (durable-only when memory_dir cannot hold it); 0 turns the tier off."""
    memory_dir: str = "/dev/shm"
    """Memory-backed directory (tmpfs) the daemon keeps the memory tier in, under
    `trainingd-<run_id>-<node_rank>/`; size it for 2 snapshots per local rank (plus 2 of each
    of the previous node's ranks on several nodes, its replica): the start-up line
    `memory_budget` says what it needs."""
    memory_replicas: int = -1
    """Peer replicas of each node's memory snapshots, streamed to the next node's daemon so a
    replaced node resumes from memory: -1 picks 1 when `--nnodes` allows several nodes, else
    0; 0 turns them off; 1 needs several nodes (more than 1 is not supported)."""
    memory_replica_address: str = ""
    """`host[:port]` the daemon's replica server binds and advertises to its peers (port 0 or
    none: a free one); empty: the host this node is known by in the rendezvous."""
    memory_replica_streams: int = 4
    """TCP connections each replica stream to the next node uses: a snapshot of 8 MiB or more
    is striped over them, so more than one core carries it at each end (1 to 16)."""
    staging_nice: int = 10
    """How many nice steps below the training thread each rank's staging thread copies its
    snapshots (0 to 19; 0: the same priority). Where no core is spare (a CPU job on every
    core) the copy then fills the cores' idle gaps first instead of taking half a core from
    the step: `memory_every 1` cost a 256 MiB job 0.8-0.9 of a memcpy of its state a step at
    10 against 1.1-1.6 at 0; where a core is spare it changes nothing (Linux; a nice value is
    per thread)."""

    def __post_init__(self) -> None:
        if not self.ckpt_uri:
            raise ValueError("ckpt_uri is empty: give a local path or s3://bucket/prefix")
        _non_negative(self, "ckpt_every")
        if self.max_consecutive_save_failures < 1:
            raise ValueError(
                f"max_consecutive_save_failures={self.max_consecutive_save_failures}: use 1 or "
                "more (1 stops the run at the first failed save)"
            )
        if not 0 <= self.s3_spread_prefixes <= 256:
            raise ValueError(
                f"s3_spread_prefixes={self.s3_spread_prefixes}: use 0 (plain names) to 256"
            )
        if self.s3_endpoint_url and not self.s3_endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"s3_endpoint_url={self.s3_endpoint_url!r}: use http(s)://host:port")
        if not isinstance(self.memory_every, StepInterval):
            raise ValueError(f"memory_every={self.memory_every!r}: use {StepInterval.ALLOWED}")
        if self.memory_replicas not in (-1, 0, 1):
            raise ValueError(
                f"memory_replicas={self.memory_replicas}: use 1 (the next node holds a replica), "
                "0 (off) or -1 (1 with several nodes); more than one replica is not supported"
            )
        if self.memory_replica_address.count(":") == 1:
            port = self.memory_replica_address.rpartition(":")[2]
            if not port.isdigit() or int(port) > 65535:
                raise ValueError(
                    f"memory_replica_address={self.memory_replica_address!r}: use host[:port] "
                    "with a port in 0..65535 (0: a free one)"
                )
        if not 1 <= self.memory_replica_streams <= 16:
            raise ValueError(
                f"memory_replica_streams={self.memory_replica_streams}: use 1 (one connection) "
                "to 16"
            )
        if not 0 <= self.staging_nice <= 19:
            raise ValueError(
                f"staging_nice={self.staging_nice}: use 0 (the training thread's priority) to 19"
            )
        if not Path(self.memory_dir).is_absolute():
            raise ValueError(
                f"memory_dir={self.memory_dir!r}: use an absolute path to a memory-backed "
                "directory, e.g. /dev/shm"
            )


class StragglerAction(enum.StrEnum):
    """What the daemon does when it names a straggler (`straggler_action`)."""

    NONE = "none"
    """Name it (log, metric, alert, status page) and nothing else: operators decide."""
    RESTART = "restart"
    """Also kill its node's worker group, as the hang detector does (a counted restart)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class ObservabilitySettings:
    """The metrics/health endpoint and logs."""

    metrics_host: str = "127.0.0.1"
    """Address the /metrics, /healthz, /readyz server binds (0.0.0.0 in a pod)."""
    metrics_port: int = 9464
    """Port of that server; 0 picks a free port and logs it."""
    publish_interval_s: float = 0.5
    """Longest time between two metric snapshots of a rank."""
    heartbeat_timeout_s: float = 300.0
    """/healthz fails when a rank's loop has not beaten for this long."""
    hang_timeout_s: TimeoutSeconds = TimeoutSeconds()
    """A training rank without progress for this long is hung: stacks dumped, group restarted;
    auto (or 0) is max(60 s, 10 x p99 step time); start-up and restore use at least
    heartbeat_timeout_s."""
    straggler_threshold: float = 1.3
    """A rank whose median compute time over the window is this many times the median rank's
    is a straggler (logged `rank_straggler`, its score exported, alert TrainingdRankStraggler)."""
    straggler_window_steps: int = 50
    """Steps in the straggler window (also at most `straggler_window_s` old); 0 turns the
    per-step exchange of compute times off (scores stay 0)."""
    straggler_window_s: float = 30.0
    """Seconds the straggler window reaches back at most (slow steps: fewer steps in it)."""
    straggler_action: StragglerAction = StragglerAction.NONE
    """What the daemon does about a straggler: `none` (name it; operators decide) or `restart`
    (kill its group as the hang detector does: a counted restart)."""
    final_scrape_wait_s: float = 30.0
    """After a run ends on purpose (max_steps, drained, stopped with a peer), keep /metrics up
    until one scrape has read the finished state, so the target's disappearance raises no
    TrainingdDaemonDown; waits at most this long, less once the scraper misses twice its own
    cadence, and not at all when nothing ever scraped. Keep it under the grace period minus
    shutdown_timeout_s; 0 turns the wait off."""
    log_format: LogFormat = LogFormat.AUTO
    """`json`, `console`, or `auto` (console on a TTY)."""
    log_level: str = "info"
    """Minimum log level: debug, info, warning, error."""
    log_every_s: float = 10.0
    """Off a terminal: seconds between two structured `progress` log events (step, loss,
    tokens/s, ETA, last checkpoint, restarts); a terminal shows a live status line instead."""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port}: use 0..65535")
        _positive(self, "publish_interval_s", "heartbeat_timeout_s", "log_every_s")
        if not isinstance(self.hang_timeout_s, TimeoutSeconds):
            raise ValueError(
                f"hang_timeout_s={self.hang_timeout_s!r}: use {TimeoutSeconds.ALLOWED} "
                "(a TimeoutSeconds)"
            )
        if not self.straggler_threshold > 1.0:
            raise ValueError(
                f"straggler_threshold={self.straggler_threshold}: use a ratio > 1 (e.g. 1.3: "
                "30% slower than the median rank)"
            )
        if self.straggler_window_steps != 0 and self.straggler_window_steps < 5:
            raise ValueError(
                f"straggler_window_steps={self.straggler_window_steps}: use 0 (off) or >= 5 "
                "(a median needs a few steps)"
            )
        _positive(self, "straggler_window_s")
        if not isinstance(self.straggler_action, StragglerAction):
            raise ValueError(
                f"straggler_action={self.straggler_action!r}: use "
                + " or ".join(a.value for a in StragglerAction)
            )
        if not self.final_scrape_wait_s >= 0:
            raise ValueError(
                f"final_scrape_wait_s={self.final_scrape_wait_s}: use seconds >= 0 (0: no wait)"
            )
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level={self.log_level!r}: use debug, info, warning or error")


@dataclasses.dataclass(kw_only=True, frozen=True)
class DaemonConfig:
    """Everything `trainingd run` needs; one section per component."""

    launch: LaunchSettings = dataclasses.field(default_factory=LaunchSettings)
    """Local ranks, rendezvous, restarts, shutdown."""
    train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
    """Job, steps, sharding, optimizer."""
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    """Checkpoint root, cadence, retention, writer mode."""
    observability: ObservabilitySettings = dataclasses.field(default_factory=ObservabilitySettings)
    """Metrics endpoint and logs."""

    def __post_init__(self) -> None:
        lc, micro = self.launch, self.train.micro_batches
        if self.checkpoint.memory_replicas == 1 and lc.max_nodes < 2:
            raise ValueError(
                f"memory_replicas=1: the ring of nnodes={lc.nnodes!r} cannot hold a replica (it "
                "is held by another node); use 0, or -1 (1 with several nodes)"
            )
        size = self.train.shard_group_size
        worlds = [n * lc.nproc_per_node for n in range(lc.min_nodes, lc.max_nodes + 1)]
        if size and any(world % size for world in worlds):
            bad = next(world for world in worlds if world % size)
            raise ValueError(
                f"shard_group_size={size} does not divide the world size {bad} (nnodes="
                f"{lc.nnodes!r} x nproc_per_node={lc.nproc_per_node}); use a divisor of "
                "nproc_per_node, or 0 (one node's ranks)"
            )
        if not lc.elastic:
            return
        # [Note: an elastic job keeps its global batch] see `micro_batches_at`.
        need = math.lcm(*range(lc.min_nodes, lc.max_nodes + 1))
        step = need // math.gcd(need, lc.max_nodes)
        if micro % step:
            short = next(n for n in range(lc.min_nodes, lc.max_nodes) if lc.max_nodes * micro % n)
            raise ValueError(
                f"nnodes={lc.nnodes!r} with micro_batches={micro}: an elastic job keeps the global "
                f"batch of {lc.max_nodes} nodes (batch_size x micro_batches x {lc.max_nodes} x "
                f"nproc_per_node), which {short} nodes cannot split evenly; use micro_batches a "
                f"multiple of {step}, or a narrower nnodes range"
            )

    def micro_batches_at(self, world_size: int) -> int:
        """Micro-batches each rank accumulates per optimizer step at `world_size` ranks.

        [Note: an elastic job keeps its global batch] With a fixed `nnodes` the global batch is
        `batch_size x micro_batches x world_size`. With `MIN:MAX` it is fixed at the largest
        world, `batch_size x micro_batches x max_nodes x nproc_per_node`: a smaller world
        accumulates more micro-batches, so every step consumes the same global samples (data
        position, counted in global samples, and the per-step LR schedule stay exact across a
        membership change). `DaemonConfig` checks at load time that every node count in the
        range splits it evenly.

        Raises:
            ValueError: `world_size` ranks cannot split the elastic global batch evenly.
        """
        lc, micro = self.launch, self.train.micro_batches
        if not lc.elastic:
            return micro
        per_step = micro * lc.max_nodes * lc.nproc_per_node
        if world_size <= 0 or per_step % world_size:
            raise ValueError(
                f"world size {world_size} cannot split the elastic global batch of {per_step} "
                f"micro-batches (micro_batches={micro} x {lc.max_nodes} nodes x "
                f"{lc.nproc_per_node} ranks); every node must run nproc_per_node="
                f"{lc.nproc_per_node}"
            )
        return per_step // world_size

    def shard_group_size_at(self, world_size: int) -> int | None:
        """`sharding.ShardingConfig.shard_group_size` at `world_size` ranks (None: no replicas).

        [Note: hybrid by default across nodes] ZeRO-3 over the whole world makes every
        all-gather and reduce-scatter cross every node; sharding within a node and
        all-reducing each gradient shard across nodes keeps the per-unit collectives on the
        node's fast links and sends one shard-sized all-reduce per bucket between nodes
        (`sharding/_mesh.py`). So `optim_grads_params` on several nodes and `hybrid` shard
        within `nproc_per_node` ranks unless `shard_group_size` is set (the whole world: set
        it to the world size). With one rank per node that would hold the whole model on
        every rank, so `optim_grads_params` then keeps sharding over the whole world
        (`hybrid` does as told).
        """
        tc = self.train
        if tc.strategy is StrategyName.NO_SHARD:
            return None
        size = tc.shard_group_size
        if size == 0:
            per_node = self.launch.nproc_per_node
            multi_node = world_size > per_node
            within_node = tc.strategy is StrategyName.HYBRID or (
                tc.strategy is StrategyName.OPTIM_GRADS_PARAMS and multi_node and per_node > 1
            )
            size = per_node if within_node else world_size
        return None if size >= world_size else size

    @property
    def run_id(self) -> str:
        """The run id: `launch.run_id`, or `<job module>-<hash of job and checkpoint root>`."""
        if self.launch.run_id:
            return self.launch.run_id
        where = self.train.job.rpartition(":")[0]
        # `pkg.my_job:build` -> my_job; `path/to/my_job.py:build` -> my_job.
        module = where.rsplit("/", 1)[-1].removesuffix(".py").rsplit(".", 1)[-1]
        # A valid explicit id starts with a letter or digit; so does a derived one (`_x` -> `x`).
        name = module.strip("_").replace("_", "-") or "job"
        digest = hashlib.sha256(f"{self.train.job}\n{self.checkpoint.ckpt_uri}".encode())
        return f"{name}-{digest.hexdigest()[:10]}"

    @property
    def memory_tier_dir(self) -> Path:
        """This node's memory-tier directory: `<memory_dir>/trainingd-<run_id>-<node_rank>`.

        The daemon claims it at start and removes it at exit (`daemon/agent/memory_dir.py`);
        its ranks, handed the same config, keep their snapshot slots in it, so a restarted rank
        finds them.
        """
        name = f"trainingd-{self.run_id}-{self.launch.node_rank}"
        return Path(self.checkpoint.memory_dir) / name

    @property
    def num_memory_replicas(self) -> int:
        """Peer replicas in force: `memory_replicas`, -1 resolved (1 with several nodes); 0
        while the memory tier is off."""
        if self.checkpoint.memory_every.is_off:
            return 0
        wanted = self.checkpoint.memory_replicas
        return (1 if self.launch.max_nodes > 1 else 0) if wanted == -1 else wanted

    @property
    def rdzv_id(self) -> str:
        """The rendezvous id: `launch.rdzv_id`, or the run id."""
        return self.launch.rdzv_id or self.run_id
