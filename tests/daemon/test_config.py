"""Configuration: precedence, rejection of unknown keys and bad values, TOML round trip."""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_manager import AnyOf, AsyncMode, KeepBest, KeepEvery, KeepInterval, KeepLast, MetricMode
from daemon._config_load import config_keys, config_reference, dump_toml, load_config
from daemon.config import (
    DaemonConfig,
    Device,
    ObservabilitySettings,
    Precision,
    StepInterval,
    StrategyName,
    TimeoutSeconds,
)
from daemon.errors import ConfigError

BIN = Path(sys.executable).parent


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_run_id_is_derived_from_job_and_root(tmp_path: Path) -> None:
    cfg = load_config({}, env={})
    assert cfg.train.strategy is StrategyName.OPTIM_GRADS_PARAMS
    assert Path(cfg.checkpoint.ckpt_uri).is_absolute()
    same = load_config({"ckpt_uri": cfg.checkpoint.ckpt_uri}, env={})
    assert same.run_id == cfg.run_id
    assert cfg.run_id.startswith("default-job-")
    other = load_config({"ckpt_uri": str(tmp_path)}, env={})
    assert other.run_id != cfg.run_id
    assert load_config({"run_id": "mine"}, env={}).run_id == "mine"
    assert cfg.rdzv_id == cfg.run_id


def test_a_run_id_derived_from_a_private_module_is_a_valid_run_id() -> None:
    cfg = load_config({"job": "tests.daemon._gated_job:build"}, env={})
    assert cfg.run_id.startswith("gated-job-")
    # The derived id passes the same check an explicit one does.
    assert load_config({"run_id": cfg.run_id}, env={}).run_id == cfg.run_id


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nmax_steps = 10\nlr = 0.5\nseed = 3\n")
    env = {"TRAININGD_MAX_STEPS": "20", "TRAININGD_LR": "0.25"}
    cfg = load_config({"max_steps": "30"}, env=env, file=path)
    assert cfg.train.max_steps == 30  # flag
    assert cfg.train.lr == 0.25  # env beats file
    assert cfg.train.seed == 3  # file beats default
    assert cfg.train.batch_size == DaemonConfig().train.batch_size  # default
    by_env = load_config({}, env={"TRAININGD_CONFIG": str(path)})
    assert by_env.train.max_steps == 10


@pytest.mark.parametrize(
    ("flags", "env", "toml", "match"),
    [
        ({}, {}, "[train]\nmax_stepz = 1\n", r"key 'max_stepz'.*did you mean 'max_steps'"),
        ({}, {}, "[bogus]\nx = 1\n", r"unknown config section \[bogus\]"),
        ({}, {}, "[launch]\nmax_steps = 1\n", r"belongs in \[train\]"),
        ({}, {"TRAININGD_NOPE": "1"}, "", r"unknown config key 'nope' \(from \$TRAININGD_NOPE\)"),
        ({"max_steps": "-1"}, {}, "", r"max_steps=-1: use 0 or more \(from --max-steps\)"),
        ({}, {}, "[train]\nmax_steps = -4\n", r"max_steps=-4: use 0 or more \(from .*c.toml"),
        ({"max_steps": "ten"}, {}, "", r"'ten' \(from --max-steps\) is invalid: use an int"),
        ({"async_mode": "later"}, {}, "", r"use one of persistent, temporal, sync"),
        ({"param_dtype": "float16"}, {}, "", r"use one of float32, bfloat16"),
        ({}, {}, "[train]\nmax_steps = 1.5\n", r"use an integer"),
        ({"nnodes": "2"}, {}, "", r"rdzv_endpoint is empty"),
        ({"metrics_port": "70000"}, {}, "", r"metrics_port=70000"),
        ({"job": "nocolon"}, {}, "", r"job='nocolon': use module:callable"),
        ({"max_inflight_reductions": "0"}, {}, "", r"max_inflight_reductions=0: use 1 or more"),
        ({}, {}, "[train\n", r"not valid TOML"),
        ({"log_every_s": "0"}, {}, "", r"log_every_s=0.0: use a positive number \(from --log-e"),
        ({}, {"TRAININGD_LOG_EVERY_S": "-5"}, "", r"log_every_s=-5.0: use a positive.*LOG_EVERY_S"),
        ({"log_every_s": "often"}, {}, "", r"'often' \(from --log-every-s\) is invalid: use a num"),
        ({"device": "tpu"}, {}, "", r"'tpu' \(from --device\) is invalid: use one of auto, cpu"),
        ({}, {"TRAININGD_DEVICE": "gpu"}, "", r"'gpu' \(from \$TRAININGD_DEVICE\).*auto, cpu, cu"),
        ({"keep_every": "-1"}, {}, "", r"keep_every=-1: use 0 or more \(0 disables it\) \(from"),
        ({}, {}, "[checkpoint]\nkeep_last = -2\n", r"keep_last=-2: use 0 or .*c.toml \[checkp"),
        ({"keep_best_mode": "median"}, {}, "", r"'median' \(from --keep-best-mode\).*min, max"),
        ({"keep_best": "2"}, {}, "", r"keep_best=2 needs keep_best_metric .*\(from --keep-best\)"),
        ({}, {"TRAININGD_KEEP_BEST_METRIC": "loss"}, "", r"with keep_best=0.*KEEP_BEST_METRIC\)$"),
        ({"keep_interval_s": "soon"}, {}, "", r"'soon' \(from --keep-interval-s\).*use a number"),
        ({}, {}, "[train]\nkeep_last = 1\n", r"'keep_last' belongs in \[checkpoint\]"),
        ({"memory_every": "often"}, {}, "", r"'often' \(from --memory-every\).*use auto, or a"),
        ({}, {}, "[checkpoint]\nmemory_every = -1\n", r"memory_every=-1 \(from .*whole number"),
        ({}, {"TRAININGD_MEMORY_EVERY": "2.5"}, "", r"'2.5' \(from \$TRAININGD_MEMORY_EVERY\)"),
        ({"memory_dir": "shm"}, {}, "", r"memory_dir='shm': use an absolute path .*--memory-dir"),
    ],
)  # fmt: skip
def test_bad_keys_and_values_name_the_key_and_the_fix(
    tmp_path: Path, flags: dict[str, str], env: dict[str, str], toml: str, match: str
) -> None:
    path = _write(tmp_path, toml) if toml else None
    with pytest.raises(ConfigError, match=match) as info:
        load_config(flags, env=env, file=path)
    assert "\n" not in str(info.value)


def test_log_every_s_defaults_to_10_and_comes_from_file_env_or_flag(tmp_path: Path) -> None:
    assert load_config({}, env={}).observability.log_every_s == 10.0
    path = _write(tmp_path, "[observability]\nlog_every_s = 30\n")
    assert load_config({}, env={}, file=path).observability.log_every_s == 30.0
    env = {"TRAININGD_LOG_EVERY_S": "2.5"}
    assert load_config({}, env=env, file=path).observability.log_every_s == 2.5
    assert load_config({"log_every_s": "1"}, env=env).observability.log_every_s == 1.0


def test_device_defaults_to_auto_and_comes_from_file_env_or_flag(tmp_path: Path) -> None:
    assert load_config({}, env={}).train.device is Device.AUTO
    path = _write(tmp_path, '[train]\ndevice = "cpu"\n')
    assert load_config({}, env={}, file=path).train.device is Device.CPU
    env = {"TRAININGD_DEVICE": "cuda"}
    assert load_config({}, env=env, file=path).train.device is Device.CUDA
    assert load_config({"device": "cpu"}, env=env).train.device is Device.CPU


def test_memory_tier_keys_default_to_auto_in_dev_shm_and_come_from_anywhere(
    tmp_path: Path,
) -> None:
    cfg = load_config({"run_id": "r", "node_rank": "0"}, env={})
    assert cfg.checkpoint.memory_every == StepInterval(None)
    assert cfg.checkpoint.memory_every.is_auto
    assert cfg.memory_tier_dir == Path("/dev/shm/trainingd-r-0")
    path = _write(tmp_path, '[checkpoint]\nmemory_every = 4\nmemory_dir = "/mnt/tier"\n')
    from_file = load_config({}, env={}, file=path)
    assert from_file.checkpoint.memory_every == StepInterval(4)
    assert str(from_file.memory_tier_dir).startswith("/mnt/tier/trainingd-")
    assert load_config({}, env={"TRAININGD_MEMORY_EVERY": "0"}).checkpoint.memory_every.is_off
    quoted = _write(tmp_path, '[checkpoint]\nmemory_every = "AUTO"\n')
    assert load_config({"memory_every": None}, env={}, file=quoted).checkpoint.memory_every.is_auto
    assert load_config({"memory_every": "12"}, env={}).checkpoint.memory_every.steps == 12
    for setting in ("7", "auto"):
        cfg = load_config({"memory_every": setting}, env={})
        dumped = dump_toml(cfg)
        assert ("memory_every = 7" if setting == "7" else 'memory_every = "auto"') in dumped
        assert load_config({}, env={}, file=_write(tmp_path, dumped)) == cfg


def test_hang_timeout_is_auto_by_default_zero_is_auto_too_and_other_text_is_refused(
    tmp_path: Path,
) -> None:
    assert load_config({}, env={}).observability.hang_timeout_s.is_auto
    assert 'hang_timeout_s = "auto"' in dump_toml(load_config({}, env={}))
    quoted = _write(tmp_path, '[observability]\nhang_timeout_s = "Auto"\n')
    assert load_config({}, env={}, file=quoted).observability.hang_timeout_s.is_auto
    number = _write(tmp_path, "[observability]\nhang_timeout_s = 4\n")
    assert load_config({}, env={}, file=number).observability.hang_timeout_s.seconds == 4.0
    env = {"TRAININGD_HANG_TIMEOUT_S": "2.5"}
    assert load_config({}, env=env).observability.hang_timeout_s == TimeoutSeconds(2.5)
    assert load_config({"hang_timeout_s": "auto"}, env=env).observability.hang_timeout_s.is_auto
    # 0 stays an alias of auto and is shown, and written back, as auto.
    zero = load_config({"hang_timeout_s": "0"}, env={})
    assert zero.observability.hang_timeout_s.is_auto
    assert str(zero.observability.hang_timeout_s) == "auto"
    for setting in ("7.5", "auto"):
        cfg = load_config({"hang_timeout_s": setting}, env={})
        dumped = dump_toml(cfg)
        expected = "hang_timeout_s = 7.5" if setting == "7.5" else 'hang_timeout_s = "auto"'
        assert expected in dumped
        assert load_config({}, env={}, file=_write(tmp_path, dumped)) == cfg
    for bad in ("soon", "-1", "inf", "nan", "true"):
        with pytest.raises(ConfigError, match=r"hang_timeout_s=.* is invalid: use auto, or a"):
            load_config({"hang_timeout_s": bad}, env={})
    with pytest.raises(ConfigError, match=r"hang_timeout_s=True .* is invalid: use auto"):
        load_config({}, env={}, file=_write(tmp_path, "[observability]\nhang_timeout_s = true\n"))
    with pytest.raises(ValueError, match=r"hang_timeout_s=3.0: use auto, or a number"):
        ObservabilitySettings(hang_timeout_s=3.0)  # type: ignore[arg-type]


def test_memory_replicas_default_to_one_with_several_nodes_and_refuse_what_the_ring_cannot_hold(
    tmp_path: Path,
) -> None:
    two = {"nnodes": "2", "rdzv_endpoint": "n0:1"}
    assert load_config({}, env={}).num_memory_replicas == 0
    assert load_config(two, env={}).num_memory_replicas == 1
    assert load_config({"nnodes": "1:2", "rdzv_endpoint": "n0:1"}, env={}).num_memory_replicas == 1
    assert load_config({**two, "memory_replicas": "0"}, env={}).num_memory_replicas == 0
    assert load_config({**two, "memory_every": "0"}, env={}).num_memory_replicas == 0
    path = _write(tmp_path, '[checkpoint]\nmemory_replica_address = "10.0.0.5:7070"\n')
    assert load_config({}, env={}, file=path).checkpoint.memory_replica_address == "10.0.0.5:7070"
    with pytest.raises(ConfigError, match=r"memory_replicas=1: the ring of nnodes='1'"):
        load_config({"memory_replicas": "1"}, env={})
    with pytest.raises(ConfigError, match=r"memory_replicas=2: .*more than one replica is not"):
        load_config({**two, "memory_replicas": "2"}, env={})
    with pytest.raises(ConfigError, match=r"memory_replica_address='h:x': use host\[:port\]"):
        load_config({**two, "memory_replica_address": "h:x"}, env={})
    assert load_config({}, env={}).checkpoint.memory_replica_streams == 4
    one = load_config({"memory_replica_streams": "1"}, env={})
    assert one.checkpoint.memory_replica_streams == 1
    for bad in ("0", "17"):
        with pytest.raises(ConfigError, match=rf"memory_replica_streams={bad}: use 1 .* to 16"):
            load_config({"memory_replica_streams": bad}, env={})


def test_staging_nice_is_checked_and_reaches_the_manager() -> None:
    from daemon.rank.loop import _checkpoint_config

    assert load_config({}, env={}).checkpoint.staging_nice == 10
    assert _checkpoint_config(load_config({}, env={})).staging_nice == 10
    same = load_config({"staging_nice": "0"}, env={})
    assert _checkpoint_config(same).staging_nice == 0
    for bad in ("-1", "20"):
        with pytest.raises(ConfigError, match=rf"staging_nice={bad}: use 0 .* to 19"):
            load_config({"staging_nice": bad}, env={})


def test_retention_keys_build_the_engines_policy(tmp_path: Path) -> None:
    assert load_config({}, env={}).checkpoint.retention.policy() == KeepLast(n=3)
    both = load_config({"keep_every": "1000"}, env={}).checkpoint.retention.policy()
    assert both == AnyOf(KeepLast(n=3), KeepEvery(every=1000))
    # keep_last = 0 keeps every checkpoint, keep_every then changes nothing (as before).
    assert (
        load_config({"keep_last": "0", "keep_every": "1000"}, env={}).checkpoint.retention.policy()
        is None
    )
    path = _write(
        tmp_path, '[checkpoint]\nkeep_best = 2\nkeep_best_metric = "loss"\nkeep_last = 1\n'
    )
    env = {"TRAININGD_KEEP_BEST_MODE": "max", "TRAININGD_KEEP_INTERVAL_S": "3600"}
    cfg = load_config({"keep_best": "4"}, env=env, file=path)
    assert cfg.checkpoint.retention.policy() == AnyOf(
        KeepLast(n=1),
        KeepInterval(interval_s=3600.0),
        KeepBest(metric="loss", n=4, mode=MetricMode.MAX),
    )
    dumped = dump_toml(cfg)
    assert 'keep_best_mode = "max"' in dumped
    assert "keep_interval_s = 3600.0" in dumped


def test_dump_toml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(
        {"max_steps": "7", "async_mode": "sync", "rdzv_endpoint": "h:1", "nnodes": "1:2"}, env={}
    )
    again = load_config({}, env={}, file=_write(tmp_path, dump_toml(cfg)))
    assert again == cfg
    assert again.checkpoint.async_mode is AsyncMode.SYNC
    assert (again.launch.min_nodes, again.launch.max_nodes) == (1, 2)


def test_every_key_has_a_docstring_flag_and_reference_row() -> None:
    ref = config_reference()
    for key in config_keys():
        assert f"--{key.replace('_', '-')}" in ref
        assert f"TRAININGD_{key.upper()}" in ref
    assert "| `[train] max_steps` |" in ref
    assert all(row.count("|") >= 5 and not row.endswith("|  |") for row in ref.splitlines())


def test_enums_are_the_engines_or_named_apart_from_them() -> None:
    import ckpt_manager
    import sharding
    from daemon import config

    # The writer mode is the engine's own enum, parsed by value.
    assert config.CheckpointSettings().async_mode is ckpt_manager.AsyncMode.PERSISTENT
    assert load_config({"async_mode": "SYNC"}, env={}).checkpoint.async_mode is AsyncMode.SYNC
    # No enum of the config shadows an engine's by name ...
    engine_names = set(sharding.__all__) | set(ckpt_manager.__all__)
    own = {n for n in config.__all__ if isinstance(getattr(config, n), enum.EnumMeta)}
    assert not own & engine_names, own & engine_names
    # ... and the strategy names are the engine's values plus `hybrid` (ZeRO-3 within a node).
    assert {s.engine_strategy for s in StrategyName} == {s.value for s in sharding.Strategy}
    assert {s.value for s in StrategyName} - {s.value for s in sharding.Strategy} == {"hybrid"}
    for precision in Precision:  # each names a dtype the engine's policy accepts
        dtype = getattr(torch, precision.value)
        sharding.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


def test_config_show_prints_effective_toml_and_bad_config_exits_2(tmp_path: Path) -> None:
    exe = BIN / "trainingd"
    out = subprocess.run(
        [exe, "config", "show", "--max-steps", "9"],
        capture_output=True,
        text=True,
        env={"TRAININGD_SEED": "5", "PATH": ""},
        check=True,
    )
    assert "max_steps = 9" in out.stdout
    assert "seed = 5" in out.stdout
    bad = subprocess.run(
        [exe, "run", "--max-steps", "-3"],
        capture_output=True,
        text=True,
        env={"PATH": ""},
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "trainingd: max_steps=-3: use 0 or more (from --max-steps)"
    ]


def test_an_elastic_job_keeps_its_global_batch_at_every_node_count() -> None:
    cfg = load_config({"nnodes": "1:2", "rdzv_endpoint": "n0:29400", "nproc_per_node": "2"}, env={})
    # [Note: an elastic job keeps its global batch]: 2 nodes x 2 ranks x 1 micro-batch.
    assert [cfg.micro_batches_at(w) for w in (4, 2)] == [1, 2]
    fixed = load_config({"nnodes": "2", "rdzv_endpoint": "n0:29400"}, env={})
    assert [fixed.micro_batches_at(w) for w in (4, 2)] == [1, 1]  # fixed: per rank, as set
    with pytest.raises(ValueError, match=r"world size 3 cannot split .* nproc_per_node=2"):
        cfg.micro_batches_at(3)
    wide = {"nnodes": "2:4", "rdzv_endpoint": "n0:29400", "micro_batches": "3"}
    assert load_config(wide, env={}).micro_batches_at(3 * 2) == 4
    with pytest.raises(ConfigError, match=r"nnodes='2:4' with micro_batches=1: .* 3 nodes") as e:
        load_config({**wide, "micro_batches": "1"}, env={})
    assert "multiple of 3" in str(e.value)
    assert "\n" not in str(e.value)


def test_zero3_shards_within_the_node_on_several_nodes_unless_told_otherwise() -> None:
    two = {"nnodes": "2", "rdzv_endpoint": "n0:29400", "nproc_per_node": "4"}
    # [Note: hybrid by default across nodes]: 2 nodes x 4 ranks -> 2 replicas of 4 shards.
    assert load_config(two, env={}).shard_group_size_at(8) == 4
    assert load_config({**two, "shard_group_size": "8"}, env={}).shard_group_size_at(8) is None
    assert load_config({**two, "shard_group_size": "2"}, env={}).shard_group_size_at(8) == 2
    for strategy in ("optim", "optim_grads", "no_shard"):
        cfg = load_config({**two, "strategy": strategy}, env={})
        assert cfg.shard_group_size_at(8) is None, strategy
    one = {"nproc_per_node": "4"}
    assert load_config(one, env={}).shard_group_size_at(4) is None
    hybrid = load_config({**one, "strategy": "hybrid"}, env={})
    assert hybrid.shard_group_size_at(4) is None  # one node: the node is the whole world
    assert hybrid.train.strategy.engine_strategy == "optim_grads_params"
    elastic = {"nnodes": "1:2", "rdzv_endpoint": "n0:29400", "nproc_per_node": "2"}
    assert [load_config(elastic, env={}).shard_group_size_at(w) for w in (2, 4)] == [None, 2]
    # One rank per node: sharding within the node would hold the whole model on every rank.
    single = {"nnodes": "2", "rdzv_endpoint": "n0:29400", "nproc_per_node": "1"}
    assert load_config(single, env={}).shard_group_size_at(2) is None
    assert load_config({**single, "strategy": "hybrid"}, env={}).shard_group_size_at(2) == 1


def test_shard_group_size_must_divide_every_world_and_needs_a_sharded_strategy() -> None:
    elastic = {"nnodes": "1:2", "rdzv_endpoint": "n0:29400", "nproc_per_node": "2"}
    with pytest.raises(ConfigError, match=r"shard_group_size=4 does not divide the world size 2"):
        load_config({**elastic, "shard_group_size": "4"}, env={})
    with pytest.raises(ConfigError, match=r"no_shard replicates everything; use strategy=hybrid"):
        load_config({"strategy": "no_shard", "shard_group_size": "2"}, env={})
    with pytest.raises(ConfigError, match="shard_group_size"):
        load_config({"shard_group_size": "-1"}, env={})
