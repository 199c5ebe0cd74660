"""Rank stack dumps: the signal a rank answers with its Python stacks, the file, its parsing.

Each rank installs `faulthandler` for `STACK_DUMP_SIGNAL` (SIGUSR2; SIGUSR1 already asks for a
checkpoint) at start, writing every thread's stack to `stacks/rank-<r>.txt` in the run
directory. faulthandler writes from the C signal handler, so a rank whose Python is stuck in a
C call (a collective, a read) still answers; a stopped process (SIGSTOP) cannot, and the daemon
reports it as `stopped` instead (`daemon/agent/hang.py`). `innermost_frame` picks the frame an
operator wants from a dump: the innermost one of our packages or of the job, not of the
interpreter or a library. `waits_in_collective` tells a rank that waits for a peer from one
that is stuck itself: the engine's gradient reductions and all-gathers are waited on inside
the forward and backward passes, so the progress phase alone (`collective` only for the
loop's per-step agreement) cannot.
"""

from __future__ import annotations

import faulthandler
import re
import signal
import sysconfig
from pathlib import Path
from typing import IO, NamedTuple

__all__ = [
    "STACK_DUMP_SIGNAL",
    "Frame",
    "hang_stacks_path",
    "innermost_frame",
    "install_stack_dump",
    "is_ours_or_jobs",
    "parse_stacks",
    "stacks_path",
    "waits_in_collective",
]

STACK_DUMP_SIGNAL = signal.SIGUSR2
"""The signal a rank answers with its stacks (faulthandler; the process goes on)."""

_OUR_PACKAGES = ("daemon", "sharding", "ckpt_manager")
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_COLLECTIVE_LIBRARY = "/torch/distributed/"
"""A library frame under this path is a collective (or the process group's store) waiting."""
_COLLECTIVE_WAITS = (("sharding/_comm.py", "wait"),)
"""Frames of ours that block on an issued collective (`PendingCollective.wait`)."""
_OPEN_DUMPS: list[IO[str]] = []
"""The open dump file (faulthandler needs it open for the life of the process)."""


class Frame(NamedTuple):
    """One frame of a dump."""

    file: str
    """Source file as the interpreter knows it."""
    line: int
    """Line number."""
    function: str
    """Function name."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def stacks_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` writes its stacks inside the per-run directory."""
    return run_dir / "stacks" / f"rank-{rank}.txt"


def hang_stacks_path(run_dir: Path, rank: int, pid: int) -> Path:
    """Where the daemon keeps the dump of rank `rank`'s process `pid` taken for a hang.

    [Note: a hang's stacks outlive the restart] The rank's own file is truncated by the next
    incarnation (`install_stack_dump`), which the restart that follows a hang starts within
    about a second: the dump an operator is pointed to (`rank_hung`'s `stacks`, the status
    page) was seen empty. The daemon copies what it read into this file, which nothing
    rewrites.
    """
    return run_dir / "stacks" / f"rank-{rank}.pid-{pid}.txt"


def install_stack_dump(run_dir: Path, rank: int) -> Path:
    """Make this process write all its threads' stacks to its file on `STACK_DUMP_SIGNAL`.

    Returns:
        The dump file's path (truncated: an older incarnation's dump is gone).
    """
    path = stacks_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    dump = path.open("w")
    faulthandler.register(STACK_DUMP_SIGNAL, file=dump, all_threads=True)
    while _OPEN_DUMPS:
        _OPEN_DUMPS.pop().close()
    _OPEN_DUMPS.append(dump)
    return path


def parse_stacks(text: str) -> list[list[Frame]]:
    """Every thread of a faulthandler dump, its frames innermost first; the current thread
    (the one the signal interrupted, the main thread for a rank) comes first."""
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if (head := _THREAD.match(line)) is not None:
            threads.append((head.group(1) == "Current thread", []))
        elif (frame := _FRAME.match(line)) is not None and threads:
            threads[-1][1].append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    threads.sort(key=lambda t: not t[0])
    return [frames for _, frames in threads]


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def is_ours_or_jobs(file: str, library_roots: tuple[str, ...] | None = None) -> bool:
    """Whether a frame's file is our packages' or the job's (not the interpreter's, not a
    library's): our packages count wherever they are installed."""
    parts = Path(file).parts
    if any(p in _OUR_PACKAGES for p in parts[-3:-1]):
        return True
    if file.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    roots = _library_roots() if library_roots is None else library_roots
    return not any(file.startswith(root.rstrip("/") + "/") for root in roots)


def _training_first(threads: list[list[Frame]]) -> list[list[Frame]]:
    """The threads, those whose stack passes through our rank entry or loop first."""

    def trains(frames: list[Frame]) -> bool:
        return any(f.file.endswith(("daemon/worker.py", "daemon/rank/loop.py")) for f in frames)

    return [t for t in threads if trains(t)] + [t for t in threads if not trains(t)]


def innermost_frame(
    threads: list[list[Frame]], library_roots: tuple[str, ...] | None = None
) -> Frame | None:
    """The innermost frame of our code or the job's in the thread that trains.

    The training thread is the first (current thread first) whose stack passes through our
    rank entry (`daemon/worker.py`) or loop; without one, the first thread with any frame of
    ours or the job's. None when no thread has one.
    """
    for frames in _training_first(threads):
        for frame in frames:
            if is_ours_or_jobs(frame.file, library_roots):
                return frame
    return None


def waits_in_collective(
    threads: list[list[Frame]], library_roots: tuple[str, ...] | None = None
) -> bool:
    """Whether the thread that trains is blocked waiting on a collective (for its peers).

    It is when, from its innermost frame outwards up to the first frame of ours or the job's,
    a library frame is torch.distributed's, or that first frame of ours is the engine's wait
    on an issued collective (`sharding/_comm.py` `wait`). A rank spinning in the job's code,
    or stuck in a read or a lock, is not.
    """
    ordered = _training_first(threads)
    if not ordered or not ordered[0]:
        return False
    for frame in ordered[0]:
        if not is_ours_or_jobs(frame.file, library_roots):
            if _COLLECTIVE_LIBRARY in frame.file:
                return True
            continue
        return any(
            frame.file.endswith(path) and frame.function == function
            for path, function in _COLLECTIVE_WAITS
        )
    return False
