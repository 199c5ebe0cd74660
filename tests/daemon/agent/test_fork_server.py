"""Ranks forked from the daemon's fork server start as spawned ones do, with imports done.

The first test plays the daemon in a process of its own (`tests/daemon/_fork_server_probe.py`)
and compares, rank by rank, what a spawned and a forked rank see: environment (the agent's
per-rank variables and the daemon's own, as of the rank's start), output relayed through the
daemon, working directory, `sys.path`, CUDA untouched. The others check the server's refusal of
an unsafe state and the layering of what it preloads.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import worker
from daemon.agent.fork_server import ServerState, preload_modules
from tests.daemon._fork_server_probe import ADDED, REMOVED

REPO = Path(__file__).resolve().parents[3]

# Values that differ between any two launches, spawned or not: the round's master port and
# the attempt's error file (a fresh log folder per agent).
_PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forked_rank_sees_what_a_spawned_one_sees_with_its_imports_done(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    subprocess.run(
        [sys.executable, "-c", "from tests.daemon._fork_server_probe import main; main()", out],
        cwd=REPO,
        check=True,
        timeout=280,
    )
    result = json.loads(out.read_text())
    spawned, forked = result["spawn"], result["fork_server"]
    assert len(spawned["ranks"]) == len(forked["ranks"]) == 2
    for s, f in zip(spawned["ranks"], forked["ranks"], strict=True):
        env_s, env_f = s.pop("environ"), f.pop("environ")
        for key in _PER_LAUNCH:
            assert env_s.pop(key), key
            assert env_f.pop(key), key
        assert env_f == env_s
        # The daemon's environment at the rank's start, not at the server's.
        assert env_f[ADDED] == "1"
        assert REMOVED not in env_f
        assert env_f["LOCAL_RANK"] in ("0", "1")
        assert env_f["TORCHELASTIC_USE_AGENT_STORE"] == env_s["TORCHELASTIC_USE_AGENT_STORE"]
        assert (s["warm"], f["warm"]) == (False, True)
        assert (s["parent_is_daemon"], f["parent_is_daemon"]) == (True, False)
        assert f["grandparent_is_daemon"]  # forked by the daemon's server
        assert f["parent_threads"] == 1  # the server runs no thread besides its main one
        assert s["cuda_initialized"] is f["cuda_initialized"] is False
        for key in ("cwd", "sys_path", "pgid_is_daemons"):
            assert f[key] == s[key], key
    assert forked["lines"] == spawned["lines"]
    assert len(forked["lines"]) == 6  # 3 lines per rank, stdout and stderr, relayed
    assert result["server_alive_after_close"] is False


def _state(**changes: object) -> ServerState:
    safe = ServerState(
        pid=1,
        threads=("python",),
        cuda_initialized=False,
        cuda_driver_initialized=False,
        missing=(),
    )
    return safe._replace(**changes)


def test_an_unsafe_server_is_refused_with_the_reason() -> None:
    assert _state().unsafe_reason() is None
    assert _state(missing=("some_job",)).unsafe_reason() is None  # ranks import it themselves
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" in str(
        _state(cuda_driver_initialized=True).unsafe_reason()
    )
    assert "torch's CUDA state" in str(_state(cuda_initialized=True).unsafe_reason())
    assert "runs 2 threads after its imports (python, worker)" in str(
        _state(threads=("python", "worker")).unsafe_reason()
    )
    assert "imports" in str(_state(missing=("daemon.agent._server_state",)).unsafe_reason())


_START_THREADED = """
import os
from daemon._lifecycle import parent_of, pid_alive
from daemon.agent.fork_server import ForkServer
from daemon.errors import ForkServerError
try:
    ForkServer.start(["threaded_job", "daemon.agent._server_state"], timeout_s=60)
except ForkServerError as err:
    print(err)
servers = []
for entry in os.listdir("/proc"):
    if entry.isdigit() and parent_of(int(entry)) == os.getpid() and pid_alive(int(entry)):
        with open(f"/proc/{entry}/cmdline") as f:
            servers += ["forkserver" in f.read()]
print("servers left:", sum(servers))
"""


def test_a_server_whose_imports_start_a_thread_is_refused_and_stopped(tmp_path: Path) -> None:
    job = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n"
    (tmp_path / "threaded_job.py").write_text(job)
    path = os.pathsep.join(p for p in (str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", _START_THREADED],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "the server runs 2 threads after its imports" in out.stdout, out.stderr
    assert "servers left: 0" in out.stdout


def test_the_server_preloads_every_module_a_rank_imports_when_it_starts() -> None:
    # `run_rank` imports the rank side lazily (the daemon imports daemon.worker); what it
    # imports there is what the server must have imported ahead.
    tree = ast.parse(inspect.getsource(worker.run_rank))
    lazy = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert lazy - {"torch"} <= set(worker.RANK_MODULES)
    modules = preload_modules("my.jobs:build", worker.elastic_entry.__module__, worker.RANK_MODULES)
    assert modules[0] == "torch"
    assert {"daemon.worker", "my.jobs", *worker.RANK_MODULES} <= set(modules)
    assert modules[-1] == "daemon.agent._server_state"  # recorded after every other import


_LAZY_IMPORTS = """
import ast, importlib, json, sys
from daemon import worker
import daemon.rank.loop as loop
for name in worker.RANK_MODULES:
    importlib.import_module(name)
before = set(sys.modules)
for node in ast.walk(ast.parse(open(loop.__file__).read())):
    if isinstance(node, ast.FunctionDef):
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module:
                module = importlib.import_module(inner.module)
                for alias in inner.names:
                    getattr(module, alias.name)
ours = ("ckpt_manager", "sharding", "daemon")
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ours)))
"""


def test_what_the_training_loop_imports_lazily_is_preloaded() -> None:
    # The loop's function-level imports (`ckpt_manager`'s lazy public names: the manager and
    # its 60 modules) ran in every rank after the fork, on each restart's critical path
    # ([Note: the recovery timeline] in bench/recovery_timeline.py).
    path = os.pathsep.join(
        [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, "-c", _LAZY_IMPORTS],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout) == [], out.stderr


def test_what_trainingd_run_imports_before_it_launches_the_server_loads_no_torch() -> None:
    # [Note: the server imports while the daemon does]: a torch import that creeps into this
    # chain makes the daemon import torch before the server can start, and the overlap is gone.
    code = (
        "import sys, daemon.cli, daemon.worker, daemon.agent.fork_server, daemon.config\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


_LAUNCH_THEN = """
import os, sys, time
from daemon._lifecycle import parent_of, pid_alive
from daemon.agent import fork_server

# Joined here, so this script's own command line (a child's before its exec) does not hold it.
MARK = " ".join(["multiprocessing.forkserver", "import", "main"])

def servers():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == os.getpid() and pid_alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline") as f:
                    command = f.read()
            except OSError:
                continue
            found += [int(entry)] if MARK in command else []
    return found

def launched():
    # multiprocessing does not wait for the server's exec: its command line shows in a moment.
    deadline = time.monotonic() + 60
    while not servers() and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(servers())

modules = ["json", "daemon.agent._server_state"]
fork_server.launch(modules)
if sys.argv[1] == "at_once":
    fork_server.stop_unclaimed()  # before the server's exec may have shown
    seen, deadline = 0, time.monotonic() + 2
    while time.monotonic() < deadline:
        seen = max(seen, len(servers()))
        time.sleep(0.01)
    print("left:", seen)
    sys.exit(0)
print("launched:", launched())
if sys.argv[1] == "claim":
    server = fork_server.ForkServer.start(modules, timeout_s=60)
    print("claimed the launched one:", servers() == [server.pid])
    fork_server.stop_unclaimed()  # nothing to stop: it was taken over
    print("after stop_unclaimed:", len(servers()))
    server.close()
else:
    fork_server.stop_unclaimed()
print("left:", len(servers()))
"""


@pytest.mark.parametrize("claim", [True, False], ids=["taken_over", "unclaimed"])
def test_a_launched_server_is_taken_over_by_start_or_stopped_unclaimed(claim: bool) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCH_THEN, "claim" if claim else "drop"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "launched: 1" in out.stdout, out.stderr
    if claim:
        assert "claimed the launched one: True" in out.stdout, out.stderr
        assert "after stop_unclaimed: 1" in out.stdout, out.stderr
    assert out.stdout.rstrip().endswith("left: 0"), out.stdout + out.stderr


def test_a_server_stopped_right_after_its_launch_is_stopped_before_its_exec_shows() -> None:
    # [Note: an unclaimed server is known by its pid]: a daemon failing its start-up checks at
    # once stops the server it just launched, whose command line may not be the server's yet.
    for _ in range(5):  # the window is short: several tries
        out = subprocess.run(
            [sys.executable, "-c", _LAUNCH_THEN, "at_once"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.rstrip() == "left: 0", out.stdout + out.stderr
