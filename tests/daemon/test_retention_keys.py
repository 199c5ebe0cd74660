"""A retention policy is declared once: one registered in this test, and in no other file,
reaches the retention record, `ckptctl`'s flags and trainingd's configuration."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from ckpt_manager import AnyOf, AsyncMode, CheckpointConfig, CheckpointManager, KeepLast, StepInfo
from ckpt_manager._retention import registry
from ckpt_manager._retention.record import RETENTION_NAME, read_retention
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main as ckptctl
from daemon._config_load import add_config_flags, config_reference, dump_toml, load_config
from daemon.errors import ConfigError


@dataclasses.dataclass(kw_only=True, frozen=True)
class KeepModulo:
    """Keep the steps with `step % divisor == remainder`."""

    divisor: int
    remainder: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.remainder < self.divisor:
            raise ValueError(f"KeepModulo(remainder={self.remainder}): use 0 to divisor - 1")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.divisor == self.remainder}


SPEC = registry.PolicySpec(
    kind="keep_modulo",
    policy=KeepModulo,
    params=(
        registry.Param(
            name="divisor",
            value_type=int,
            flag="--keep-modulo",
            key="keep_modulo",
            metavar="N",
            help="keep the steps whose remainder by N is --modulo-remainder",
        ),
        registry.Param(
            name="remainder",
            value_type=int,
            flag="--modulo-remainder",
            key="keep_modulo_remainder",
            metavar="R",
            help="the remainder kept",
            default=0,
        ),
    ),
    label=lambda p: f"modulo-{p.divisor}r{p.remainder}",
)


@pytest.fixture
def keep_modulo(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KeepModulo` registered for this test only."""
    registry.specs()  # the built-ins first
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    registry.register(SPEC)


def _committed(root: pathlib.Path, steps: range, policy: Any) -> None:
    config = CheckpointConfig(async_mode=AsyncMode.SYNC, retention=policy)
    with CheckpointManager(str(root), config, run_id="modulo") as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.zeros(2)})
        mgr.wait_until_finished()


def _ckptctl_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    capsys.readouterr()  # drop the manager's log lines
    assert ckptctl([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "dumped.toml"
    path.write_text(text)
    return path


def test_a_registered_policy_reaches_the_record_ckptctl_and_the_daemon_config(
    keep_modulo: None, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The record: the manager writes it at start-up, `list` labels steps from it.
    policy = AnyOf(KeepLast(n=1), KeepModulo(divisor=3, remainder=1))
    _committed(tmp_path, range(1, 8), policy)
    doc = json.loads(Storage(str(tmp_path)).read(RETENTION_NAME))
    assert doc["policies"][1] == {"kind": "keep_modulo", "divisor": 3, "remainder": 1}
    assert read_retention(Storage(str(tmp_path))) == [
        ("last-1", KeepLast(n=1)),
        ("modulo-3r1", KeepModulo(divisor=3, remainder=1)),
    ]
    reasons = {r["step"]: r["retained_by"] for r in _ckptctl_json(capsys, "list", str(tmp_path))}
    assert reasons[7] == ["latest", "last-1", "modulo-3r1"]
    assert reasons[4] == ["modulo-3r1"]
    assert all(why == [] for step, why in reasons.items() if step % 3 != 1)

    # ckptctl: its flags, an option's default, and its checks.
    plan = _ckptctl_json(capsys, "prune", str(tmp_path), "--keep-modulo", "2", "--dry-run")
    assert [k["step"] for k in plan["keep"]] == [s for s in reasons if s % 2 == 0 or s == 7]
    plan = _ckptctl_json(
        capsys, "prune", str(tmp_path), "--keep-modulo", "2", "--modulo-remainder", "1", "--dry-run"
    )
    assert plan["delete"] == [s for s in reasons if s % 2 == 0]
    assert ckptctl(["prune", str(tmp_path), "--modulo-remainder", "1"]) == 2
    assert "--modulo-remainder is used only with --keep-modulo N" in capsys.readouterr().err
    assert ckptctl(["prune", str(tmp_path), "--keep-modulo", "2", "--modulo-remainder", "5"]) == 2
    assert "KeepModulo(remainder=5): use 0 to divisor - 1" in capsys.readouterr().err

    # trainingd: a TOML key, a TRAININGD_* variable and a flag, with the usual precedence.
    toml = tmp_path / "c.toml"
    toml.write_text("[checkpoint]\nkeep_modulo = 5\nkeep_modulo_remainder = 2\n")
    env = {"TRAININGD_KEEP_MODULO": "4"}
    cfg = load_config({"keep_modulo_remainder": "3"}, env=env, file=toml)
    assert cfg.checkpoint.retention.policy() == AnyOf(
        KeepLast(n=3), KeepModulo(divisor=4, remainder=3)
    )
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = vars(parser.parse_args(["--keep-modulo", "6", "--keep-last", "0"]))
    assert load_config(flags, env={}).checkpoint.retention.policy() is None  # keep_last = 0
    assert "keep_modulo = 4" in dump_toml(cfg)
    assert load_config({}, env={}, file=_write(tmp_path, dump_toml(cfg))) == cfg
    assert "| `[checkpoint] keep_modulo` | `--keep-modulo` `TRAININGD_KEEP_MODULO` | `0` |" in (
        config_reference()
    )
    with pytest.raises(
        ConfigError, match=r"^keep_modulo=-1: use 0 or more .*\(from --keep-modulo\)"
    ):
        load_config({"keep_modulo": "-1"}, env={})
    with pytest.raises(ConfigError, match=r"keep_modulo=2: KeepModulo\(remainder=2\).*\$TRAINING"):
        load_config({}, env={"TRAININGD_KEEP_MODULO": "2", "TRAININGD_KEEP_MODULO_REMAINDER": "2"})


def test_without_the_registration_the_policy_is_unknown_everywhere(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same inputs as above, with KeepModulo not registered: the test above is not vacuous.
    with pytest.raises(ConfigError, match=r"unknown config key 'keep_modulo'"):
        load_config({}, env={"TRAININGD_KEEP_MODULO": "4"})
    assert ckptctl(["prune", str(tmp_path), "--keep-modulo", "2"]) == 2
    assert "unrecognized arguments: --keep-modulo" in capsys.readouterr().err
    storage = Storage(str(tmp_path))
    storage.write(
        RETENTION_NAME,
        json.dumps(
            {
                "format": "trainingd-retention",
                "format_version": 1,
                "run_id": "x",
                "policies": [{"kind": "keep_modulo", "divisor": 3, "remainder": 1}],
                "custom": [],
            }
        ).encode(),
    )
    assert read_retention(storage) is None
