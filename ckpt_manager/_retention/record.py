"""The run's retention policy, recorded in the checkpoint root for `ckptctl`.

The manager's coordinator writes `_RETENTION.json` at start-up (after taking the lease), so
`ckptctl list` can say why each step survives (`last-3`, `every-1000`, `best loss`) without
being told the policy again; its flags still override. A run without a policy removes the
file, so an earlier run's policy is never shown for this one::

    {"format": "trainingd-retention", "format_version": 1, "run_id": "...",
     "policies": [{"kind": "keep_last", "n": 3}, {"kind": "keep_every", "every": 1000},
                  {"kind": "keep_interval", "interval_s": 3600.0},
                  {"kind": "keep_best", "metric": "loss", "n": 1, "mode": "min"}],
     "custom": ["MyPolicy"]}

`AnyOf` is flattened into `policies`. A policy of another type cannot be described; it is
named in `custom`, and readers then show no policy reasons at all rather than reasons that
would miss what the custom policy keeps.
"""

from __future__ import annotations

import json
from typing import Any

from ckpt_manager._retention.policies import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    MetricMode,
    RetentionPolicy,
)
from ckpt_manager._store.storage import Storage

__all__ = ["RETENTION_NAME", "label_of", "read_retention", "record_retention"]

RETENTION_NAME = "_RETENTION.json"
_FORMAT = "trainingd-retention"

Labelled = list[tuple[str, RetentionPolicy]]


def label_of(policy: RetentionPolicy) -> str | None:
    """What `ckptctl` prints for a built-in policy (`last-3`, `best-2 loss`); None otherwise."""
    if isinstance(policy, KeepLast):
        return f"last-{policy.n}"
    if isinstance(policy, KeepEvery):
        return f"every-{policy.every}"
    if isinstance(policy, KeepInterval):
        return f"interval-{policy.interval_s:g}s"
    if isinstance(policy, KeepBest):
        best = "best" if policy.n == 1 else f"best-{policy.n}"
        return f"{best} {policy.metric}"
    return None


def _parts(policy: RetentionPolicy) -> list[RetentionPolicy]:
    if isinstance(policy, AnyOf):
        return [q for p in policy.policies for q in _parts(p)]
    return [policy]


def _to_doc(policy: RetentionPolicy) -> dict[str, Any] | None:
    if isinstance(policy, KeepLast):
        return {"kind": "keep_last", "n": policy.n}
    if isinstance(policy, KeepEvery):
        return {"kind": "keep_every", "every": policy.every}
    if isinstance(policy, KeepInterval):
        return {"kind": "keep_interval", "interval_s": policy.interval_s}
    if isinstance(policy, KeepBest):
        return {"kind": "keep_best", "metric": policy.metric, "n": policy.n, "mode": policy.mode}
    return None


def _from_doc(doc: Any) -> RetentionPolicy:
    kind = doc["kind"]
    if kind == "keep_last":
        return KeepLast(n=int(doc["n"]))
    if kind == "keep_every":
        return KeepEvery(every=int(doc["every"]))
    if kind == "keep_interval":
        return KeepInterval(interval_s=float(doc["interval_s"]))
    if kind == "keep_best":
        mode = MetricMode(doc["mode"])
        return KeepBest(metric=str(doc["metric"]), n=int(doc["n"]), mode=mode)
    raise ValueError(f"unknown retention policy kind {kind!r}")


def record_retention(storage: Storage, run_id: str, policy: RetentionPolicy | None) -> None:
    """Record `policy` in the root (coordinator, at start-up); None removes the record.

    Raises:
        StorageError: the write or delete failed.
    """
    if policy is None:
        storage.remove(RETENTION_NAME)
        return
    described: list[dict[str, Any]] = []
    custom: list[str] = []
    for part in _parts(policy):
        doc = _to_doc(part)
        if doc is None:
            custom.append(type(part).__name__)
        else:
            described.append(doc)
    body = {
        "format": _FORMAT,
        "format_version": 1,
        "run_id": run_id,
        "policies": described,
        "custom": custom,
    }
    storage.write(RETENTION_NAME, json.dumps(body, sort_keys=True).encode())


def read_retention(storage: Storage) -> Labelled | None:
    """The recorded policy as labelled parts; None when absent, unreadable or not describable.

    Never raises for a bad record (it only feeds `ckptctl list`'s reasons): a damaged or
    newer-format file reads as no record.

    Raises:
        StorageError: the root cannot be read.
    """
    try:
        # One GET even when absent (see `lease.read_lease`).
        raw = storage.read_with_version(RETENTION_NAME)[0]
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        if doc.get("format") != _FORMAT or int(doc["format_version"]) != 1 or doc["custom"]:
            return None
        parts = [_from_doc(d) for d in doc["policies"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    out: Labelled = []
    for part in parts:
        label = label_of(part)
        assert label is not None  # every kind `_from_doc` builds has a label
        out.append((label, part))
    return out or None
