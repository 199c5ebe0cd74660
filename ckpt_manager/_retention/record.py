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

`AnyOf` is flattened into `policies`; each entry is the registry's form of a policy
(`registry.to_doc`: its `kind` and one field per parameter), so a policy registered later is
recorded and read back with no change here. A policy that is not registered cannot be
described; it is named in `custom`, and readers then show no policy reasons at all rather
than reasons that would miss what the custom policy keeps.
"""

from __future__ import annotations

import json
from typing import Any

from ckpt_manager._retention.base import AnyOf, RetentionPolicy
from ckpt_manager._retention.registry import from_doc, label_of, to_doc
from ckpt_manager._store.storage import Storage

__all__ = ["RETENTION_NAME", "read_retention", "record_retention"]

RETENTION_NAME = "_RETENTION.json"
_FORMAT = "trainingd-retention"

Labelled = list[tuple[str, RetentionPolicy]]


def _parts(policy: RetentionPolicy) -> list[RetentionPolicy]:
    if isinstance(policy, AnyOf):
        return [q for p in policy.policies for q in _parts(p)]
    return [policy]


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
        doc = to_doc(part)
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
        parts = [from_doc(d) for d in doc["policies"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    out: Labelled = []
    for part in parts:
        label = label_of(part)
        assert label is not None  # every kind `from_doc` builds is registered
        out.append((label, part))
    return out or None
