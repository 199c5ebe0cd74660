"""`ckptctl show` (a manifest in human or JSON form) and `ckptctl verify` (re-read and check).

Verification is `steps.verify_files`, the check restore itself runs, applied one file at
a time so that every bad file is reported, not only the first. Every step checked ends with a
verdict (`ok`, `corrupt` with one problem per bad object, a missing one as `missing <name>`,
`uncommitted`, and with `--all` the `quarantined` folders): the step to check is resolved from
its manifest alone, so a missing index or shard is a finding, never a read error.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.pins import pinned_steps
from ckpt_manager._store.quarantine import QUARANTINE_DIR, list_quarantined, read_record
from ckpt_manager._store.steps import list_step_dirs, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.common import committed_of, parallel_map
from ckpt_manager.ctl.list import strategy_of
from ckpt_manager.ctl.render import format_age, format_bytes, format_local_time, iso_local, table
from ckpt_manager.errors import CheckpointError, StepNotFoundError

__all__ = ["StepCheck", "newest_committed_step", "render_manifest", "show_json", "verify_steps"]


def show_json(storage: Storage, m: Manifest) -> dict[str, Any]:
    """`show --json`: summary fields plus the manifest exactly as stored (validated).

    The stored document is read again (one GET): a format-1 manifest is read, never
    serialised, and a tool may have re-indented one.

    Raises:
        CorruptCheckpointError: the stored manifest no longer validates.
        StorageError: the read failed.
    """
    stored = storage.read(f"{step_dir(m.step)}/{MANIFEST_NAME}")
    Manifest.from_json(stored, expected_step=m.step)
    return {
        "step": m.step,
        "committed_at": iso_local(m.committed_unix_s),
        "bytes": m.num_bytes,
        "strategy": strategy_of(m),
        "pinned": m.step in pinned_steps(storage),
        "manifest": json.loads(stored),
    }


def render_manifest(storage: Storage, m: Manifest, now: float | None = None) -> str:
    """`show`: header, metrics, versions, files, tensors and rank-local state."""
    now = time.time() if now is None else now
    pinned = m.step in pinned_steps(storage)
    lines = [
        f"step {m.step} of {storage.root_uri}",
        f"  run id      {m.run_id}",
        f"  world size  {m.world_size}   strategy {strategy_of(m)}   pinned {pinned}",
        f"  created     {format_local_time(m.created_unix_s)}",
        f"  committed   {format_local_time(m.committed_unix_s)} "
        f"({format_age(now - m.committed_unix_s)} ago)",
        f"  size        {format_bytes(m.num_bytes)} in {len(m.files)} files",
        "  versions    " + " ".join(f"{k}={v}" for k, v in sorted(m.versions.items())),
        "  metrics     "
        + (" ".join(f"{k}={v}" for k, v in m.metrics.items()) if m.metrics else "(none)"),
        "",
        "files:",
    ]
    file_rows = [
        [name, format_bytes(f.size), str(f.size), f"{f.crc32:#010x}"]
        for name, f in sorted(m.files.items())
    ]
    lines.append(_indent(table(["NAME", "SIZE", "BYTES", "CRC32"], file_rows, right={1, 2})))
    lines += ["", "tensors:"]
    tensor_rows = []
    for key, rec in m.tensors.items():
        pieces = rec["pieces"]
        form = "flat" if any(p.flat_range is not None for p in pieces) else "box"
        shards = f"{len(pieces)} ({form})" if rec["kind"] == "sharded" else "1"
        shape = "x".join(map(str, rec["global_shape"])) or "scalar"
        tensor_rows.append([key, rec["dtype"], shape, rec["kind"], shards])
    headers = ["NAME", "DTYPE", "GLOBAL SHAPE", "KIND", "SHARDS"]
    lines.append(_indent(table(headers, tensor_rows, right=set())))
    local = [rl for rl in m.rank_local if rl["tensors"] or rl["trees"]]
    if local:
        lines += ["", f"rank-local state: {len(m.rank_local)} ranks"]
        for rank, rl in enumerate(m.rank_local):
            keys = ", ".join(rl["tensors"]) or "(values only)"
            lines.append(f"  rank {rank}: {keys}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """Verification outcome of one step."""

    step: int
    """Training step."""
    status: str
    """`ok`, `corrupt`, `uncommitted` or `quarantined` (moved aside under `_quarantine/`)."""
    num_files: int
    """Files checked."""
    num_bytes: int
    """Bytes re-read."""
    problems: tuple[str, ...]
    """One line per bad file (or the manifest's problem)."""

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return dataclasses.asdict(self) | {"problems": list(self.problems)}


def _check_file(storage: Storage, m: Manifest, name: str) -> str | None:
    try:
        verify_files(storage, m, [name], check_crc=True)
    except CheckpointError as err:
        text = str(err).removeprefix(f"step {m.step}: ")
        if text == f"file {name} is missing":
            return f"missing {name}"
        return f"{name}: {text}"
    return None


def _verify_one(storage: Storage, step: int) -> StepCheck:
    try:
        m = read_manifest(storage, step)
    except StepNotFoundError:
        return StepCheck(step, "uncommitted", 0, 0, ())
    except CheckpointError as err:
        return StepCheck(step, "corrupt", 0, 0, (f"manifest.json: {err}",))
    names = sorted(m.files)
    found = parallel_map(lambda n: _check_file(storage, m, n), names, storage)
    problems = []
    for name, outcome in zip(names, found, strict=True):
        if isinstance(outcome, Exception):
            problems.append(f"{name}: {outcome}")
        elif outcome is not None:
            problems.append(outcome)
    status = "corrupt" if problems else "ok"
    return StepCheck(step, status, len(names), m.num_bytes, tuple(problems))


def verify_steps(storage: Storage, steps: Sequence[int] | None) -> list[StepCheck]:
    """Verify the given steps, or every step folder and quarantined step when `steps` is
    None."""
    if steps is not None:
        return [_verify_one(storage, s) for s in steps]
    checks = [_verify_one(storage, s) for s in list_step_dirs(storage)]
    for name in list_quarantined(storage):
        q = read_record(storage, name)
        where = f"{QUARANTINE_DIR}/{name}"
        checks.append(StepCheck(q.step, "quarantined", 0, 0, (f"{where}: {q.reason}",)))
    return sorted(checks, key=lambda c: (c.step, c.status != "quarantined"))


def newest_committed_step(storage: Storage) -> int:
    """The newest step whose manifest exists (`verify`'s default), read from no other object.

    Raises:
        StepNotFoundError: no step is committed.
    """
    committed = committed_of(storage, list_step_dirs(storage))
    if not committed:
        raise StepNotFoundError(f"{storage.root_uri}: no committed step")
    return committed[-1]


def render_checks(checks: Sequence[StepCheck]) -> str:
    """One line per step, then an indented line per bad file."""
    lines = []
    for c in checks:
        if c.status == "ok":
            lines.append(f"step {c.step}: ok ({c.num_files} files, {format_bytes(c.num_bytes)})")
        elif c.status == "uncommitted":
            lines.append(f"step {c.step}: uncommitted (no manifest; skipped)")
        elif c.status == "quarantined":
            lines.append(f"step {c.step}: quarantined, {c.problems[0]}")
        else:
            lines.append(f"step {c.step}: CORRUPT, {len(c.problems)} bad:")
            lines += [f"  {p}" for p in c.problems]
    return "\n".join(lines)
