"""Build a `DaemonConfig` from a TOML file, `TRAININGD_*` variables and flags.

Precedence per key: flag > environment > file > default. Every value is parsed by the field's
type; an unknown key (in the file, or a `TRAININGD_*` variable) or a bad value raises
`ConfigError` with one line naming the key, where it came from and what is allowed. The field
docstrings in `daemon/config.py` are the single source of the flags' help and of the README
reference (`config_reference()`), except for the `[checkpoint]` section's `keep_*` retention
keys: those, their defaults and their help come from ckpt_manager's policy registry
(`ckpt_manager.retention.config_keys()`, read at each call, so a policy registered there is a
key here with no change to this package) and fill the section's `RetentionOptions` field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import itertools
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_manager.retention import RetentionOptions
from ckpt_manager.retention import config_keys as retention_keys
from daemon.config import (
    CheckpointSettings,
    DaemonConfig,
    LaunchSettings,
    ObservabilitySettings,
    StepInterval,
    TimeoutSeconds,
    TrainSettings,
)
from daemon.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "ConfigKey",
    "add_config_flags",
    "config_keys",
    "config_reference",
    "dump_toml",
    "load_config",
]

ENV_PREFIX = "TRAININGD_"
"""Prefix of the environment variables; `TRAININGD_CONFIG` names the TOML file."""

SECTIONS: dict[str, type[Any]] = {
    "launch": LaunchSettings,
    "train": TrainSettings,
    "checkpoint": CheckpointSettings,
    "observability": ObservabilitySettings,
}


class ConfigKey(NamedTuple):
    """One config key."""

    section: str
    """Its TOML table (`checkpoint`)."""
    type: type[Any]
    """How its values are parsed (`int`, `float`, `str`, `bool` or an Enum)."""
    default: Any
    """Its value when not set."""
    help: str
    """Its meaning, on one line (the flag's help and the README row)."""


def config_keys() -> dict[str, ConfigKey]:
    """Every config key, in section order: the fields of each section, and in place of a
    `RetentionOptions` field the registry's retention keys (read now, not at import)."""
    keys: dict[str, ConfigKey] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] is RetentionOptions:
                found = {
                    k.key: ConfigKey(section, k.value_type, k.default, k.help)
                    for k in retention_keys()
                }
            else:
                doc = _docstrings(section).get(f.name, "")
                found = {f.name: ConfigKey(section, hints[f.name], f.default, doc)}
            for name, key in found.items():
                if name in keys:
                    raise RuntimeError(f"config key {name} is declared in two sections")
                keys[name] = key
    return keys


@functools.cache
def _docstrings(section: str) -> dict[str, str]:
    cls = SECTIONS[section]
    # Field docstrings are string expressions right after an annotated assignment.
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _allowed(tp: type[Any]) -> str:
    if tp is StepInterval:
        return StepInterval.ALLOWED
    if tp is TimeoutSeconds:
        return TimeoutSeconds.ALLOWED
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]


def _parse(key: str, raw: Any, tp: type[Any], origin: str) -> Any:
    """Convert `raw` (a string from a flag/env, or a TOML value) to the field type."""

    def bad() -> ConfigError:
        return ConfigError(f"{key}={raw!r} (from {origin}) is invalid: use {_allowed(tp)}")

    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(str(raw).lower())
        except ValueError:
            raise bad() from None
    if tp is StepInterval:
        try:
            return StepInterval.parse(raw)
        except ValueError:
            raise bad() from None
    if tp is TimeoutSeconds:
        try:
            return TimeoutSeconds.parse(raw)
        except ValueError:
            raise bad() from None
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise bad()
    if tp is int:
        if isinstance(raw, (bool, float)):
            raise bad()
        try:
            return int(str(raw), 10)
        except ValueError:
            raise bad() from None
    if tp is float:
        if isinstance(raw, bool):
            raise bad()
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise bad() from None
    if tp is str:
        if isinstance(raw, (dict, list, bool)):
            raise bad()
        return str(raw)
    raise AssertionError(f"config key {key} has unsupported type {tp}")


def _unknown(key: str, origin: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(config_keys()), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(
        f"unknown config key {key!r} (from {origin}); {hint}see `trainingd config show`"
    )


def _from_file(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot read it ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path}: not valid TOML ({err})") from None
    keys = config_keys()
    values: dict[str, tuple[Any, str]] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            allowed = ", ".join(f"[{s}]" for s in SECTIONS)
            raise ConfigError(f"unknown config section [{section}] in {path}; use {allowed}")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {path} must be a table: write [{section}]")
        for key, raw in table.items():
            origin = f"{path} [{section}]"
            if key not in keys:
                raise _unknown(key, origin)
            if keys[key].section != section:
                raise ConfigError(
                    f"config key {key!r} belongs in [{keys[key].section}], not [{section}]"
                )
            values[key] = (raw, origin)
    return values


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    keys = config_keys()
    values: dict[str, tuple[Any, str]] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == f"{ENV_PREFIX}CONFIG":
            continue
        key = name.removeprefix(ENV_PREFIX).lower()
        if key not in keys:
            raise _unknown(key, f"${name}")
        values[key] = (raw, f"${name}")
    return values


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: Path | str | None = None,
) -> DaemonConfig:
    """Build the effective configuration.

    Args:
        flags: parsed flag values by key (`None` values mean "not given").
        env: environment (default `os.environ`); `TRAININGD_CONFIG` names a file if `file`
            is not given.
        file: TOML file path.

    Raises:
        ConfigError: unknown key, unreadable file or invalid value (one line, naming the key).
    """
    env = os.environ if env is None else env
    if file is None and env.get(f"{ENV_PREFIX}CONFIG"):
        file = env[f"{ENV_PREFIX}CONFIG"]
    keys = config_keys()
    merged: dict[str, tuple[Any, str]] = {}
    if file is not None:
        merged.update(_from_file(Path(file)))
    merged.update(_from_env(env))
    for key, raw in (flags or {}).items():
        if raw is not None:
            if key not in keys:
                raise _unknown(key, "flags")
            merged[key] = (raw, f"--{key.replace('_', '-')}")
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, (raw, origin) in merged.items():
        section, tp = keys[key].section, keys[key].type
        per_section[section][key] = _parse(key, raw, tp, origin)
    if per_section["checkpoint"].get("ckpt_uri") is not None:
        per_section["checkpoint"]["ckpt_uri"] = _absolute(per_section["checkpoint"]["ckpt_uri"])
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        try:
            built[section] = _build(cls, per_section[section])
        except ValueError as err:
            origin = _origin_of(str(err), merged)
            raise ConfigError(f"{err}{origin}") from None
    try:
        cfg = DaemonConfig(**built)
    except ValueError as err:  # a rule across sections (elastic nnodes vs micro_batches)
        raise ConfigError(f"{err}{_origin_of(str(err), merged)}") from None
    if "ckpt_uri" not in merged:
        cfg = dataclasses.replace(
            cfg,
            checkpoint=dataclasses.replace(
                cfg.checkpoint, ckpt_uri=_absolute(cfg.checkpoint.ckpt_uri)
            ),
        )
    return cfg


def _build(cls: type[Any], values: dict[str, Any]) -> Any:
    """`cls(**values)`, with the retention keys gathered into its `RetentionOptions` field."""
    kwargs = dict(values)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if hints[f.name] is RetentionOptions:
            mine = [k.key for k in retention_keys() if k.key in kwargs]
            kwargs[f.name] = RetentionOptions(**{key: kwargs.pop(key) for key in mine})
    return cls(**kwargs)


def _absolute(uri: str) -> str:
    # Relative local roots are made absolute so the derived run id does not depend on the cwd
    # spelling and every rank sees the same root.
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def _origin_of(message: str, merged: Mapping[str, tuple[Any, str]]) -> str:
    key = message.split("=", 1)[0].strip()
    if key in merged:
        return f" (from {merged[key][1]})"
    return ""


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one `--key-name` flag per config key (values are parsed by `load_config`)."""
    keys = config_keys()
    for section in SECTIONS:
        group = parser.add_argument_group(f"[{section}]")
        for key, (sec, tp, default, text) in keys.items():
            if sec != section:
                continue
            shown = getattr(default, "value", default)
            metavar = "|".join(str(m.value) for m in tp) if issubclass(tp, enum.Enum) else None
            if tp is StepInterval:
                shown, metavar = str(default), "auto|N"
            if tp is TimeoutSeconds:
                shown, metavar = str(default), "auto|SECONDS"
            group.add_argument(
                f"--{key.replace('_', '-')}",
                dest=key,
                default=None,
                metavar=metavar or tp.__name__.upper(),
                help=f"{text} (default: {shown!r})".replace("%", "%%"),
            )


def _toml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, StepInterval):
        value = str(value) if value.is_auto else value.steps
    if isinstance(value, TimeoutSeconds):
        value = str(value) if value.is_auto else value.seconds
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def dump_toml(cfg: DaemonConfig) -> str:
    """The effective configuration as a TOML file `load_config` reads back unchanged."""
    lines = [f"# effective trainingd configuration; run id: {cfg.run_id}"]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            pairs = value.values if isinstance(value, RetentionOptions) else [(f.name, value)]
            lines.extend(f"{key} = {_toml_value(v)}" for key, v in pairs)
    return "\n".join(lines) + "\n"


def config_reference() -> str:
    """A Markdown table of every key: section, flag, variable, default, meaning."""
    rows = ["| key | flag / variable | default | meaning |", "|---|---|---|---|"]
    for key, (section, _, default, text) in config_keys().items():
        flag = f"--{key.replace('_', '-')}"
        env = f"{ENV_PREFIX}{key.upper()}"
        rows.append(
            f"| `[{section}] {key}` | `{flag}` `{env}` | `{_toml_value(default)}` | {text} |"
        )
    return "\n".join(rows)
