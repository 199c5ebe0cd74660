"""The rank error file: why a rank failed, written by the rank before it exits.

[Note: the rank writes its own error file] torch elastic's error file (`@record`) holds the
first failure's message and traceback, but not the step, the phase, the rank's restart or
whether the failure came from the job's configuration; and a rank that the agent stops
while it is still unwinding never writes one. So each rank, when its entry point raises,
replaces `ranks/local-<k>.error.json` (temp file + `os.replace`, as the snapshot) with a
`RankError`; the daemon (`daemon/agent/failures.py`) reads it for every failed process of the
attempt that wrote it (`restart` tells an older attempt's file from this one's) and combines
it with what the agent saw (exit code, signal). The format (`ERROR_SCHEMA`):

    {"schema": 1, "pid": 4242, "rank": 0, "local_rank": 0, "restart": 1, "phase": "training",
     "step": 3, "exc_type": "ValueError", "message": "...", "config": false,
     "traceback_tail": ["  File \\"job.py\\", line 12, in loss", "ValueError: ..."]}

`step` is the step the rank was training (completed steps + 1), None before the first one;
`config` is true for a failure of the job or its configuration before training started (the
job's import or build raising, `--init-from` weights that do not fit): the daemon ends the run
with exit 2 rather than retry it.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "ERROR_SCHEMA",
    "TRACEBACK_TAIL_LINES",
    "RankError",
    "error_path",
    "rank_error",
    "read_error",
    "write_error",
]

ERROR_SCHEMA = 1
"""Version of the error file format; readers skip files of another version."""
TRACEBACK_TAIL_LINES = 8
"""Last lines of the formatted traceback kept in the file (the innermost frames and the error)."""
_MAX_MESSAGE_CHARS = 2000


class RankError(NamedTuple):
    """Why one rank process failed (the error file's content)."""

    pid: int
    """The process that failed."""
    rank: int
    """Its global rank."""
    local_rank: int
    """Its rank on this node."""
    restart: int
    """The attempt it belonged to (the group's restart count, membership rounds included)."""
    phase: str
    """Its `RankPhase` when it failed."""
    step: int | None
    """The step it was training (completed steps + 1); None before training started."""
    exc_type: str
    """The exception's class name."""
    message: str
    """The exception's message (`str(err)`), first 2000 characters."""
    config: bool
    """A failure of the job or its configuration before training: not worth a retry."""
    traceback_tail: list[str]
    """The last `TRACEBACK_TAIL_LINES` lines of the formatted traceback."""


def rank_error(
    err: BaseException,
    *,
    rank: int,
    local_rank: int,
    restart: int,
    phase: str,
    step: int | None,
    config: bool,
) -> RankError:
    """The `RankError` of exception `err`, raised in this process."""
    lines = "".join(traceback.format_exception(err)).rstrip("\n").splitlines()
    return RankError(
        pid=os.getpid(),
        rank=rank,
        local_rank=local_rank,
        restart=restart,
        phase=phase,
        step=step,
        exc_type=type(err).__name__,
        message=str(err)[:_MAX_MESSAGE_CHARS],
        config=config,
        traceback_tail=lines[-TRACEBACK_TAIL_LINES:],
    )


def error_path(run_dir: Path, local_rank: int) -> Path:
    """Where local rank `local_rank` writes its error file inside the per-run directory."""
    return run_dir / "ranks" / f"local-{local_rank}.error.json"


def write_error(path: Path, error: RankError) -> None:
    """Replace the error file at `path` with `error` in one step (readers see old or new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"schema": ERROR_SCHEMA, **error._asdict()}))
    os.replace(tmp, path)


def read_error(path: Path) -> RankError | None:
    """Parse one error file; None when it is missing, torn or of another schema."""
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.pop("schema", None) != ERROR_SCHEMA:
        return None
    try:
        error = RankError(**data)
    except TypeError:
        return None
    step = error.step
    return error._replace(
        pid=int(error.pid),
        rank=int(error.rank),
        local_rank=int(error.local_rank),
        restart=int(error.restart),
        step=None if step is None else int(step),
        config=bool(error.config),
        traceback_tail=[str(line) for line in error.traceback_tail],
    )
