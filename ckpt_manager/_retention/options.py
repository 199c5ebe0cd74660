"""Retention policies from `ckptctl` flags and from configuration keys, read off the registry.

Flags (`policies_from_flags`, `flag_help`): a policy is on when its switch flag is given
(`--keep-last 3`); its options (`--metric`, `--mode`) go only with it and take their defaults
when left out; the policy class checks the values (`--keep-last 0` is an error).

Configuration keys (`config_keys`, `RetentionOptions`, `policy_from_config`): every parameter
of every registered policy is a `keep_*` key with a default, so a configuration file, an
environment variable or a flag can set it. A switch at 0 turns its policy off; the policies
that are on combine by union (`AnyOf`), in registry order.

[Note: keep_last = 0 keeps all] trainingd offered `keep_last` (default 3, where 0 keeps every
checkpoint) before any other key, and `keep_every` only added steps to a `keep_last` policy:
with `keep_last = 0` every checkpoint stayed. A spec with `zero_keeps_all` (KeepLast's) keeps
that meaning: its switch at 0 turns retention off altogether, whatever the other keys say
(they are still checked). Every other switch at 0 turns only its own policy off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from ckpt_manager._retention.base import AnyOf, RetentionPolicy
from ckpt_manager._retention.registry import REQUIRED, Param, PolicySpec, specs

__all__ = [
    "ConfigKey",
    "RetentionOptions",
    "config_keys",
    "flag_help",
    "policies_from_flags",
    "policy_from_config",
    "switch_flags",
]


def _params() -> dict[str, Param]:
    return {p.key: p for s in specs() for p in s.params}


def _check_known(keys: Mapping[str, Any]) -> None:
    known = _params()
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise ValueError(f"unknown retention key {unknown[0]!r}: use one of {', '.join(known)}")


def flag_help(spec: PolicySpec[Any], param: Param) -> str:
    """The `--help` text of `param`'s flag (an option names its switch and its default)."""
    if param is spec.switch:
        return param.help
    default = "" if param.default is REQUIRED else f"; default {param.to_json(param.default)}"
    return f"{param.help} (with {spec.switch.flag}{default})"


def switch_flags() -> list[str]:
    """The flags that turn a policy on (`--keep-last`, ...), in registry order."""
    return [s.switch.flag for s in specs()]


def policies_from_flags(given: Mapping[str, Any]) -> list[RetentionPolicy]:
    """The policies the given `ckptctl` flags turn on, in registry order.

    Args:
        given: flag values by configuration key (`keep_last`, `keep_best_metric`); None or
            absent: not given.

    Raises:
        ValueError: an unknown key, an option without its switch, a switch without a
            required option, or a value the policy rejects (each message names the flag).
    """
    _check_known(given)
    parts: list[RetentionPolicy] = []
    for spec in specs():
        switch = spec.switch
        on = given.get(switch.key) is not None
        values: dict[str, Any] = {}
        for p in spec.params:
            raw = given.get(p.key)
            if raw is not None and not on:
                raise ValueError(f"{p.flag} is used only with {switch.flag} {switch.metavar}")
            if raw is not None:
                values[p.name] = p.coerce(raw)
            elif on and p.default is REQUIRED:
                raise ValueError(f"{switch.flag} needs {p.flag} {p.metavar} ({p.help})")
            else:
                values[p.name] = p.default
        if on:
            parts.append(spec.build(values))
    return parts


class ConfigKey(NamedTuple):
    """One retention key of a configuration."""

    key: str
    """Its name (`keep_last`)."""
    value_type: type[Any]
    """`int`, `float`, `str` or a `str`-valued Enum."""
    default: Any
    """Its value when not set (a switch's 0 turns its policy off)."""
    help: str
    """One sentence: what it does, and what 0 does for a switch."""


def _config_default(spec: PolicySpec[Any], p: Param) -> Any:
    if p is spec.switch:
        return p.value_type(spec.config_default)
    # A required option not set reads as its type's empty value ("", 0).
    return p.value_type() if p.default is REQUIRED else p.default


def _config_help(spec: PolicySpec[Any], p: Param) -> str:
    text = p.help[:1].upper() + p.help[1:]
    if p is not spec.switch:
        return f"{text} (with `{spec.switch.key}`)."
    if spec.zero_keeps_all:
        return f"{text}; 0 keeps every checkpoint, whatever the other `keep_*` keys say."
    return f"{text}; 0 disables it."


def config_keys() -> list[ConfigKey]:
    """Every retention key, policy by policy (switch first), in registry order."""
    return [
        ConfigKey(p.key, p.value_type, _config_default(s, p), _config_help(s, p))
        for s in specs()
        for p in s.params
    ]


def policy_from_config(values: Mapping[str, Any]) -> RetentionPolicy | None:
    """The union of the policies the configuration keys turn on.

    Args:
        values: a value for every key of `config_keys()`, of its type.

    Returns:
        The one policy on, their `AnyOf`, or None (keep every step): no switch above 0, or
        one with `zero_keeps_all` at 0 ([Note: keep_last = 0 keeps all]).

    Raises:
        ValueError: a negative switch, an option set while its switch is 0, a required
            option missing, or a value the policy rejects; the message starts with
            `key=value` of the key to fix.
    """
    parts: list[RetentionPolicy] = []
    keep_all = False
    for spec in specs():
        switch = spec.switch
        count = values[switch.key]
        if not count >= 0:
            zero = "keeps every checkpoint" if spec.zero_keeps_all else "disables it"
            raise ValueError(f"{switch.key}={count}: use 0 or more (0 {zero})")
        if count == 0:
            for p in spec.options:
                if values[p.key] != _config_default(spec, p):
                    raise ValueError(
                        f"{p.key}={values[p.key]!r} with {switch.key}=0: set {switch.key} to "
                        f"use it (0 disables that policy), or leave {p.key} out"
                    )
            keep_all = keep_all or spec.zero_keeps_all
            continue
        built: dict[str, Any] = {switch.name: count}
        for p in spec.options:
            if p.default is REQUIRED and values[p.key] == _config_default(spec, p):
                raise ValueError(f"{switch.key}={count} needs {p.key} ({p.help})")
            built[p.name] = values[p.key]
        try:
            parts.append(spec.build(built))
        except ValueError as err:
            raise ValueError(f"{switch.key}={count}: {err}") from None
    if keep_all or not parts:
        return None
    return parts[0] if len(parts) == 1 else AnyOf(*parts)


@dataclasses.dataclass(frozen=True, init=False)
class RetentionOptions:
    """The retention keys of a configuration: the values given, defaults for the others.

    `RetentionOptions(keep_last=5, keep_best=2, keep_best_metric="loss")` is checked when
    built, so a bad value or combination fails when the configuration loads, with a message
    that starts with `key=value` of the key to fix.
    """

    values: tuple[tuple[str, Any], ...]
    """Every key of `config_keys()` with its value, in that order."""

    def __init__(self, **given: Any) -> None:
        """Check and store the keys given.

        Raises:
            ValueError: an unknown key, a value of the wrong type, or values no policy takes.
        """
        _check_known(given)
        params = _params()
        values = tuple(
            (k.key, params[k.key].coerce(given[k.key]) if k.key in given else k.default)
            for k in config_keys()
        )
        object.__setattr__(self, "values", values)
        self.policy()  # every check runs now, not when a rank first builds the policy

    def __getitem__(self, key: str) -> Any:
        """The value of retention key `key`.

        Raises:
            KeyError: not a retention key.
        """
        return dict(self.values)[key]

    def policy(self) -> RetentionPolicy | None:
        """The retention policy the keys describe (None: keep every step)."""
        return policy_from_config(dict(self.values))
