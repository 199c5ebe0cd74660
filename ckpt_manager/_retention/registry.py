"""The retention policy registry: each policy declared once, as a `PolicySpec`.

A spec names a policy (`kind`, its entry in the root's retention record), its class and its
parameters (`Param`: the class's keyword and the record's field, a type, help, a `ckptctl`
flag and a configuration key). Everything that reads or writes policies works from the specs,
never from a list of classes:

* the retention record (`record.py`): `to_doc`, `from_doc`, `label_of`;
* `ckptctl`'s flags and a tool's configuration keys (`options.py`).

[Note: a policy is one module] Each module of `policies/` defines one policy and registers its
spec when imported; that package imports every module it holds, and `specs()` imports the
package. So adding a policy is one new module (its class and its `register(PolicySpec(...))`)
and its test: the record, `ckptctl list` / `prune` flags and trainingd's `[checkpoint]` keys
pick it up from here with no other file changed.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import keyword
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Generic, TypeVar

from ckpt_manager._retention.base import RetentionPolicy

__all__ = [
    "REQUIRED",
    "Param",
    "PolicySpec",
    "from_doc",
    "label_of",
    "register",
    "specs",
    "to_doc",
]

P = TypeVar("P", bound=RetentionPolicy)


class _Required(enum.Enum):
    REQUIRED = "required"


REQUIRED: Final = _Required.REQUIRED
"""`Param.default` of a parameter that must be given whenever its policy is on."""

_KIND = re.compile(r"^[a-z][a-z0-9_]*$")
# Configuration keys share one namespace with every other key of a tool's configuration
# (trainingd's keys are unique across its sections): the `keep_` prefix keeps them apart.
_KEY = re.compile(r"^keep_[a-z0-9_]+$")
_FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
_SCALARS = (int, float, str)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Param:
    """One parameter of a retention policy, as each tool spells it."""

    name: str
    """Keyword of the policy class and field of its record entry (`n`, `metric`)."""
    value_type: type[Any]
    """`int`, `float`, `str` or a `str`-valued Enum: how flag, configuration and record values
    are read."""
    flag: str
    """`ckptctl` flag (`--keep-last`)."""
    key: str
    """Configuration key (`keep_last`: a TOML key, `TRAININGD_KEEP_LAST`, `--keep-last` of
    trainingd); starts with `keep_`."""
    metavar: str
    """Placeholder in help texts (`N`, `SECONDS`, `NAME`)."""
    help: str
    """What it means: lower case, no final period (`keep the newest N committed steps`)."""
    default: Any = REQUIRED
    """Value when not given, or `REQUIRED` (must be given whenever the policy is on). A spec's
    switch (its first parameter) has none: giving it is what turns the policy on."""

    @property
    def allowed(self) -> str:
        """The values accepted, in words (`an integer`, `one of min, max`)."""
        if issubclass(self.value_type, enum.Enum):
            return "one of " + ", ".join(str(m.value) for m in self.value_type)
        return {int: "an integer", float: "a number", str: "a string"}[self.value_type]

    def coerce(self, raw: Any) -> Any:
        """`raw` (a flag, configuration or record value) as `value_type`.

        Raises:
            ValueError: not a value of that type (`key=raw: use ...`).
        """
        tp = self.value_type
        try:
            if issubclass(tp, enum.Enum):
                return tp(raw)
            if isinstance(raw, bool):
                raise ValueError(raw)  # JSON and TOML booleans are not counts
            if tp is int and isinstance(raw, int | str):
                return int(raw)
            if tp is float and isinstance(raw, int | float | str):
                return float(raw)
            if tp is str and isinstance(raw, str):
                return raw
        except ValueError:
            pass
        raise ValueError(f"{self.key}={raw!r}: use {self.allowed}")

    def to_json(self, value: Any) -> Any:
        """`value` as its record entry writes it (an Enum by its value)."""
        if isinstance(value, enum.Enum):
            return value.value
        return self.value_type(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySpec(Generic[P]):
    """A retention policy declared once: for the record, `ckptctl` and configuration files."""

    kind: str
    """Its name in the retention record (`keep_last`)."""
    policy: type[P]
    """The class, built as `policy(**{param.name: value, ...})`; it validates the values."""
    params: tuple[Param, ...]
    """Its parameters, the switch first: an `int` or `float` whose flag turns the policy on
    (`--keep-last 3`) and whose configuration key turns it off at 0. The others (options)
    go with the switch only."""
    label: Callable[[P], str]
    """What `ckptctl list` prints for the steps a policy keeps (`last-3`, `best loss`)."""
    config_default: int | float = 0
    """The switch key's default in a configuration (0: off)."""
    zero_keeps_all: bool = False
    """A switch key at 0 keeps every step, whatever the other keys say, instead of turning
    only this policy off ([Note: keep_last = 0 keeps all] in `options.py`)."""

    @property
    def switch(self) -> Param:
        """The parameter that turns the policy on."""
        return self.params[0]

    @property
    def options(self) -> tuple[Param, ...]:
        """The parameters that go with the switch."""
        return self.params[1:]

    def build(self, values: Mapping[str, Any]) -> P:
        """The policy with `values` by parameter name.

        Raises:
            ValueError: the class rejects a value (its message says how to fix it).
        """
        return self.policy(**values)


_SPECS: dict[str, PolicySpec[Any]] = {}
"""Registered specs by kind, in registration order."""


def _param_problems(p: Param, *, switch: bool) -> list[str]:
    problems = []
    if not p.name.isidentifier() or keyword.iskeyword(p.name):
        problems.append(f"parameter name {p.name!r} is not a Python identifier")
    if not _KEY.match(p.key):
        problems.append(f"key {p.key!r}: use keep_ and lower-case words, e.g. keep_last")
    if not _FLAG.match(p.flag):
        problems.append(f"flag {p.flag!r}: use -- and lower-case words, e.g. --keep-last")
    is_enum = isinstance(p.value_type, type) and issubclass(p.value_type, enum.Enum)
    if not is_enum and p.value_type not in _SCALARS:
        problems.append(f"{p.key}: value_type {p.value_type!r}: use int, float, str or an Enum")
        return problems
    if switch:
        if p.value_type not in (int, float):
            problems.append(f"switch {p.key} must be an int or a float (0 turns it off)")
        if p.default is not REQUIRED:
            problems.append(f"switch {p.key} takes no default (giving it turns the policy on)")
    elif p.default is REQUIRED and is_enum:
        problems.append(f"{p.key} is an Enum: give it a default (a configuration needs one)")
    elif p.default is not REQUIRED:
        try:
            p.coerce(p.default)
        except ValueError as err:
            problems.append(f"default of {err}")
    return problems


def _spec_problems(spec: PolicySpec[Any]) -> list[str]:
    if not _KIND.match(spec.kind):
        return [f"kind {spec.kind!r}: use lower-case words, e.g. keep_last"]
    if not spec.params:
        return ["no parameters: the first one (the switch) turns the policy on"]
    problems = [
        problem for i, p in enumerate(spec.params) for problem in _param_problems(p, switch=i == 0)
    ]
    names = [p.name for p in spec.params]
    if len(set(names)) != len(names):
        problems.append(f"parameter names repeat: {names}")
    if not callable(getattr(spec.policy, "keep", None)):
        problems.append(f"{spec.policy!r} is not a RetentionPolicy (no keep(steps))")
    default = spec.config_default
    if isinstance(default, bool) or not isinstance(default, int | float) or not default >= 0:
        problems.append(f"config_default={default!r}: use 0 (off) or more")
    taken: dict[str, set[Any]] = {
        "kind": {s.kind for s in _SPECS.values()},
        "class": {s.policy for s in _SPECS.values()},
        "key": {p.key for s in _SPECS.values() for p in s.params},
        "flag": {p.flag for s in _SPECS.values() for p in s.params},
    }
    mine: dict[str, list[Any]] = {
        "kind": [spec.kind],
        "class": [spec.policy],
        "key": [p.key for p in spec.params],
        "flag": [p.flag for p in spec.params],
    }
    for what, values in mine.items():
        problems += [f"{what} {v!r} is already registered" for v in values if v in taken[what]]
        if len(set(values)) != len(values):
            problems.append(f"{what}s repeat: {values}")
    return problems


def register(spec: PolicySpec[P]) -> PolicySpec[P]:
    """Add `spec` to the registry (each module of `policies/` does, once, when imported).

    Returns:
        `spec`, so a module can keep it: `SPEC = register(PolicySpec(...))`.

    Raises:
        ValueError: a malformed spec, or a kind, class, key or flag already registered.
    """
    problems = _spec_problems(spec)
    if problems:
        raise ValueError(f"retention policy {spec.kind!r}: " + "; ".join(problems))
    _SPECS[spec.kind] = spec
    return spec


def specs() -> tuple[PolicySpec[Any], ...]:
    """Every registered policy, in registration order (the built-ins first)."""
    # Imports every policy module once ([Note: a policy is one module]); later calls find
    # the package in sys.modules.
    importlib.import_module("ckpt_manager._retention.policies")
    return tuple(_SPECS.values())


def _spec_of(policy: RetentionPolicy) -> PolicySpec[Any] | None:
    return next((s for s in specs() if type(policy) is s.policy), None)


def label_of(policy: RetentionPolicy) -> str | None:
    """What `ckptctl` prints for a registered policy (`last-3`, `best-2 loss`); None otherwise."""
    spec = _spec_of(policy)
    return None if spec is None else spec.label(policy)


def to_doc(policy: RetentionPolicy) -> dict[str, Any] | None:
    """The record entry of a registered policy (`{"kind": "keep_last", "n": 3}`); None
    otherwise."""
    spec = _spec_of(policy)
    if spec is None:
        return None
    return {"kind": spec.kind, **{p.name: p.to_json(getattr(policy, p.name)) for p in spec.params}}


def from_doc(doc: Mapping[str, Any]) -> RetentionPolicy:
    """The policy a record entry describes.

    A parameter missing from the entry takes its default (an option added to a policy after
    the record was written); a required one missing is a `KeyError`.

    Raises:
        ValueError: an unknown kind or a value the policy rejects.
        KeyError: a required parameter is missing.
    """
    kind = doc["kind"]
    spec = next((s for s in specs() if s.kind == kind), None)
    if spec is None:
        raise ValueError(f"unknown retention policy kind {kind!r}")
    values: dict[str, Any] = {}
    for p in spec.params:
        if p.name in doc:
            values[p.name] = p.coerce(doc[p.name])
        elif p.default is REQUIRED:
            raise KeyError(p.name)
        else:
            values[p.name] = p.default
    return spec.build(values)
