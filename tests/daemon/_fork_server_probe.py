"""What a rank sees when it starts, spawned and forked from the fork server, in one process.

Run as `python -c 'from tests.daemon._fork_server_probe import main; main()' OUT.json` (so
that `probe_entry` pickles by this module's name; a process of its own: the fork
server is one per process, and the test session has its own, `tests/support/dist.py`). It plays
the daemon: starts the fork server, then changes its environment (a rank must see the daemon's
environment when it starts, not when the server started), runs one round of 2 ranks under the
real `ElasticLauncher` with `rank_start = "spawn"`, one with `"fork_server"`, and writes what
each rank reported (`probe_entry`) and what the relay printed of their output.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ADDED = "WARM_PROBE_ADDED"
"""Set by the 'daemon' after its fork server started."""
REMOVED = "WARM_PROBE_REMOVED"
"""Set before the fork server started, removed after."""


def probe_entry(
    cfg: Any, run_dir: str, daemon_pid: int, restart_offset: int, relayed: bool
) -> dict[str, Any]:
    """A rank entry point that reports its start instead of training."""
    warm = "daemon.default_job" in sys.modules  # imported by no one in this process yet
    import torch

    from daemon._lifecycle import parent_of

    parent = os.getppid()
    os.write(1, f"rank {os.environ['RANK']} fd1\n".encode())
    print(f"rank {os.environ['RANK']} stdout", flush=True)
    print(f"rank {os.environ['RANK']} stderr", file=sys.stderr, flush=True)
    return {
        "environ": dict(os.environ),
        "warm": warm,
        "parent_is_daemon": parent == daemon_pid,
        "grandparent_is_daemon": parent_of(parent) == daemon_pid,
        "parent_threads": len(os.listdir(f"/proc/{parent}/task")),
        "cuda_initialized": torch.cuda.is_initialized(),
        "cwd": os.getcwd(),
        "sys_path": sys.path,
        "pgid_is_daemons": os.getpgid(0) == os.getpgid(daemon_pid),
    }


def _round(rank_start: str, run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    from daemon.agent.elastic import ElasticLauncher
    from daemon.agent.relay import RankOutputRelay
    from daemon.config import DaemonConfig, LaunchSettings, RankStart
    from tests.support.dist import free_port

    cfg = DaemonConfig(
        launch=LaunchSettings(nproc_per_node=2, max_restarts=0, rank_start=RankStart(rank_start))
    )
    lines: list[str] = []
    lock = threading.Lock()

    def emit(line: str) -> None:
        with lock:
            lines.append(line)

    relay = RankOutputRelay(emit).start()
    launcher = ElasticLauncher(
        cfg,
        run_dir,
        probe_entry,
        f"127.0.0.1:{free_port()}",
        on_waiting=lambda _n: None,
        relay=relay,
        rank_modules=("torch.distributed",),
    )
    outcome = launcher.run(stopping=lambda: False)
    relay.close()
    return outcome.last, sorted(lines)


def main() -> None:
    """Write `{"spawn": ..., "fork_server": ..., "server_pid": ...}` to argv[1]."""
    from daemon._lifecycle import pid_alive
    from daemon.agent.fork_server import ForkServer, preload_modules
    from daemon.config import TrainSettings

    out = Path(sys.argv[1])
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as `run_daemon`
    os.environ[REMOVED] = "1"
    # The server the launcher will find running: started before the environment changes.
    modules = preload_modules(TrainSettings().job, probe_entry.__module__, ("torch.distributed",))
    server = ForkServer.start(modules, timeout_s=300)
    del os.environ[REMOVED]
    os.environ[ADDED] = "1"
    result: dict[str, Any] = {"server_pid": server.pid}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("spawn", "fork_server"):
            run_dir = Path(tmp) / mode
            run_dir.mkdir()
            ranks, lines = _round(mode, run_dir)
            result[mode] = {"ranks": ranks, "lines": lines}
    server.close()
    result["server_alive_after_close"] = pid_alive(server.pid)
    out.write_text(json.dumps(result))
