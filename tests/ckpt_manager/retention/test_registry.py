"""The policy registry: specs checked at registration, the record form, flags and config keys."""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import pickle
from collections.abc import Sequence
from typing import Any

import pytest

from ckpt_manager import AnyOf, KeepBest, KeepEvery, KeepInterval, KeepLast, MetricMode, StepInfo
from ckpt_manager._retention import registry
from ckpt_manager._retention.options import policies_from_flags
from ckpt_manager._retention.registry import (
    Param,
    PolicySpec,
    from_doc,
    label_of,
    register,
    specs,
    to_doc,
)
from ckpt_manager.ctl.cli import build_parser
from ckpt_manager.retention import RetentionOptions, config_keys


@dataclasses.dataclass(kw_only=True, frozen=True)
class _KeepNothing:
    """A policy for malformed specs (never registered)."""

    n: int

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set()


def _spec(*params: Param, **changes: Any) -> PolicySpec[_KeepNothing]:
    fields: dict[str, Any] = {
        "kind": "keep_nothing",
        "policy": _KeepNothing,
        "params": params or (_param(),),
        "label": lambda p: "nothing",
    }
    return PolicySpec(**{**fields, **changes})


def _param(**changes: Any) -> Param:
    fields: dict[str, Any] = {
        "name": "n",
        "value_type": int,
        "flag": "--keep-nothing",
        "key": "keep_nothing",
        "metavar": "N",
        "help": "keep nothing",
    }
    return Param(**{**fields, **changes})


class _Colour(enum.StrEnum):
    RED = "red"


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by the test are forgotten after it."""
    specs()  # the built-ins first
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))


def test_the_built_ins_are_registered_first_in_listing_order() -> None:
    # A policy added later comes after them: these lists stay true without editing.
    assert [(s.kind, s.policy) for s in specs()][:4] == [
        ("keep_last", KeepLast),
        ("keep_every", KeepEvery),
        ("keep_interval", KeepInterval),
        ("keep_best", KeepBest),
    ]
    assert [p.flag for s in specs() for p in s.params][:6] == [
        "--keep-last",
        "--keep-every",
        "--keep-interval",
        "--keep-best",
        "--metric",
        "--mode",
    ]


def test_each_module_of_the_policies_package_registers_its_policy() -> None:
    # [Note: a policy is one module]: nothing lists the modules; the package imports them all.
    from ckpt_manager._retention import policies

    folder = pathlib.Path(policies.__file__).parent
    modules = {f"{policies.__name__}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    assert sorted(s.policy.__module__ for s in specs()) == sorted(modules)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (_spec(kind="keep_last"), r"kind 'keep_last' is already registered"),
        (_spec(policy=KeepLast), r"class .*KeepLast.* is already registered"),
        (_spec(_param(key="keep_every")), r"key 'keep_every' is already registered"),
        (_spec(_param(flag="--metric")), r"flag '--metric' is already registered"),
        (_spec(_param(key="nothing")), r"key 'nothing': use keep_ and lower-case words"),
        (_spec(_param(flag="-n")), r"flag '-n': use -- and lower-case words"),
        (_spec(_param(value_type=str)), r"switch keep_nothing must be an int or a float"),
        (_spec(_param(default=1)), r"switch keep_nothing takes no default"),
        (_spec(_param(value_type=list)), r"use int, float, str or an Enum"),
        (
            _spec(_param(), _param(name="c", key="keep_c", flag="--c", value_type=_Colour)),
            r"keep_c is an Enum: give it a default",
        ),
        (
            _spec(_param(), _param(name="m", key="keep_m", flag="--m", default="x")),
            r"default of keep_m='x': use an integer",
        ),
        (_spec(_param(), _param(flag="--other", key="keep_other")), r"parameter names repeat"),
        (_spec(params=()), r"no parameters"),
        (_spec(kind="Keep Nothing"), r"kind 'Keep Nothing'"),
        (_spec(policy=int), r"is not a RetentionPolicy"),
        (_spec(config_default=-1), r"config_default=-1: use 0 \(off\) or more"),
    ],
)
def test_a_malformed_or_clashing_spec_is_refused_with_the_reason(
    scratch_registry: None, spec: PolicySpec[Any], match: str
) -> None:
    before = specs()
    with pytest.raises(ValueError, match=match):
        register(spec)
    assert specs() == before


@pytest.mark.parametrize(
    ("policy", "doc", "label"),
    [
        (KeepLast(n=3), {"kind": "keep_last", "n": 3}, "last-3"),
        (KeepEvery(every=1000), {"kind": "keep_every", "every": 1000}, "every-1000"),
        (
            KeepInterval(interval_s=90),
            {"kind": "keep_interval", "interval_s": 90.0},
            "interval-90s",
        ),
        (
            KeepBest(metric="acc", n=2, mode=MetricMode.MAX),
            {"kind": "keep_best", "n": 2, "metric": "acc", "mode": "max"},
            "best-2 acc",
        ),
        (
            KeepBest(metric="loss"),
            {"kind": "keep_best", "n": 1, "metric": "loss", "mode": "min"},
            "best loss",
        ),
    ],
)
def test_record_form_and_label_of_each_built_in(
    policy: Any, doc: dict[str, Any], label: str
) -> None:
    assert to_doc(policy) == doc
    assert from_doc(doc) == policy
    assert label_of(policy) == label


def test_record_entries_take_defaults_and_reject_what_they_cannot_build() -> None:
    # An option added to a policy after a record was written reads as its default.
    assert from_doc({"kind": "keep_best", "n": 1, "metric": "loss"}) == KeepBest(metric="loss")
    with pytest.raises(KeyError):
        from_doc({"kind": "keep_best", "n": 1})
    with pytest.raises(ValueError, match="unknown retention policy kind 'keep_all'"):
        from_doc({"kind": "keep_all"})
    with pytest.raises(ValueError, match=r"keep_last=True: use an integer"):
        from_doc({"kind": "keep_last", "n": True})
    with pytest.raises(ValueError, match=r"keep at least 1 step"):
        from_doc({"kind": "keep_last", "n": 0})
    assert to_doc(AnyOf(KeepLast(n=1))) is None  # not a registered kind: the record flattens it
    assert label_of(AnyOf(KeepLast(n=1))) is None


def test_flags_turn_policies_on_and_options_go_with_their_switch() -> None:
    assert policies_from_flags({}) == []
    assert policies_from_flags({"keep_best": 2, "keep_best_metric": "acc", "keep_last": None}) == [
        KeepBest(metric="acc", n=2, mode=MetricMode.MIN)
    ]
    assert policies_from_flags(
        {"keep_best": 1, "keep_best_metric": "acc", "keep_best_mode": "max", "keep_every": 10}
    ) == [KeepEvery(every=10), KeepBest(metric="acc", mode=MetricMode.MAX)]
    with pytest.raises(ValueError, match=r"--keep-best needs --metric NAME \(the metric ranked"):
        policies_from_flags({"keep_best": 1})
    with pytest.raises(ValueError, match=r"--mode is used only with --keep-best N"):
        policies_from_flags({"keep_best_mode": "max"})
    with pytest.raises(ValueError, match=r"KeepLast\(n=0\): keep at least 1 step"):
        policies_from_flags({"keep_last": 0})
    with pytest.raises(ValueError, match=r"unknown retention key 'keep_most'"):
        policies_from_flags({"keep_most": 1})


def test_ckptctl_list_and_prune_have_one_flag_per_parameter() -> None:
    parser = build_parser()
    for command in ("list", "prune"):
        args = parser.parse_args([command, "x", "--keep-interval", "60", "--mode", "max"])
        assert (args.keep_interval_s, args.keep_best_mode, args.keep_last) == (60.0, "max", None)
    with pytest.raises(SystemExit):
        parser.parse_args(["prune", "x", "--mode", "median"])


def test_config_keys_defaults_and_the_policy_they_give() -> None:
    keys = {k.key: k for k in config_keys()[:6]}
    assert list(keys) == [
        "keep_last",
        "keep_every",
        "keep_interval_s",
        "keep_best",
        "keep_best_metric",
        "keep_best_mode",
    ]
    assert [keys[k].default for k in keys] == [3, 0, 0.0, 0, "", MetricMode.MIN]
    assert all(k.help.endswith(".") and k.help[0].isupper() for k in keys.values())
    assert RetentionOptions().policy() == KeepLast(n=3)
    every = RetentionOptions(keep_last=2, keep_every=100, keep_interval_s=60.0)
    assert every.policy() == AnyOf(
        KeepLast(n=2), KeepEvery(every=100), KeepInterval(interval_s=60.0)
    )
    best = RetentionOptions(keep_last=1, keep_best=2, keep_best_metric="acc", keep_best_mode="max")
    assert best.policy() == AnyOf(KeepLast(n=1), KeepBest(metric="acc", n=2, mode=MetricMode.MAX))
    assert best["keep_best_mode"] is MetricMode.MAX
    # [Note: keep_last = 0 keeps all]: every checkpoint stays, whatever the other keys say.
    assert RetentionOptions(keep_last=0, keep_every=100).policy() is None
    assert RetentionOptions(keep_last=0).policy() is None
    assert pickle.loads(pickle.dumps(best)) == best  # crosses into the rank processes


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"keep_last": -1}, r"^keep_last=-1: use 0 or more \(0 keeps every checkpoint\)$"),
        ({"keep_every": -5}, r"^keep_every=-5: use 0 or more \(0 disables it\)$"),
        ({"keep_interval_s": float("nan")}, r"^keep_interval_s=nan: use 0 or more"),
        ({"keep_best": 2}, r"^keep_best=2 needs keep_best_metric \(the metric ranked, e\.g\. loss"),
        ({"keep_best_metric": "loss"}, r"^keep_best_metric='loss' with keep_best=0: set keep_best"),
        ({"keep_best_mode": "median"}, r"^keep_best_mode='median': use one of min, max$"),
        ({"keep_every": "ten"}, r"^keep_every='ten': use an integer$"),
        ({"keep_most": 1}, r"^unknown retention key 'keep_most': use one of keep_last, "),
    ],
)
def test_bad_config_values_name_the_key_to_fix(given: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetentionOptions(**given)
