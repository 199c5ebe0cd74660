"""Run the real `trainingd` console script as a subprocess and observe it from outside.

`DaemonProc` starts `trainingd run` in its own session (so every process of the run, ranks and
checkpoint writers included, can be found by session id and nothing outlives a test), reads its
JSON log lines, finds the metrics URL it logs, scrapes `/metrics`, and waits with timeouts.

`Gate` is the test's side of `tests/daemon/_gated_job.py`: run a daemon with `GATED_JOB` and
`gate.env`, wait until its ranks are held at a known step, act, then open the gate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from daemon.agent.semaphores import held_semaphores, unlink_named
from tests.daemon import _gated_job

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
TRAININGD = BIN / "trainingd"
CKPTCTL = BIN / "ckptctl"
# The console script where the package is installed (as `make venv` does); the module form in a
# plain checkout, as on the device machine, whose image has the dependencies but not the
# package (the bench's daemons start through this class: BENCHMARKS.md "The next device run").
TRAININGD_COMMAND = [str(TRAININGD)] if TRAININGD.exists() else [sys.executable, "-m", "daemon.cli"]

Samples = dict[str, list[tuple[dict[str, str], float]]]

GATED_JOB = [
    "--job", "tests.daemon._gated_job:build", "--data-prefetch", "0",
    "--hang-timeout-s", str(_gated_job.HOLD_TIMEOUT_S + 30),
]  # fmt: skip
"""Flags that train the default job through the gate (no gate without `Gate.env`). The gate
counts the samples a rank reads; with batches read ahead on a thread it would close steps
early, so gated runs read on the training thread (`--data-prefetch 0`). A held rank makes no
progress: the hang budget outlasts the gate's own `HOLD_TIMEOUT_S`, else a hold longer than
the auto budget (60 s, reached under load) would be restarted as a hang."""


def session_pids(sid: int) -> list[int]:
    """Every live (non-zombie) process whose session id is `sid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[3] == str(sid) and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def rank_pids_of(sid: int) -> list[int]:
    """Rank processes of the daemon leading session `sid`: those of its session that lead
    their own process group (children of the daemon's fork server, or of the daemon when
    spawned)."""
    pids = []
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if pid != sid and fields[2] == str(pid):
            pids.append(pid)
    return pids


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `predicate` until it returns a truthy value; fail with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


class DaemonProc:
    """One `trainingd run` subprocess.

    Args:
        workdir: directory for its log files.
        args: flags after `trainingd run` (a free metrics port and JSON logs are added).
        env: extra environment variables.
        name: distinguishes log files when a test runs several daemons.
        cwd: its working directory (None: the test's).
    """

    def __init__(
        self,
        workdir: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        name: str = "d",
        cwd: Path | None = None,
    ) -> None:
        self.stderr_path = workdir / f"{name}.stderr"
        self.stdout_path = workdir / f"{name}.stdout"
        # Only the test's own TRAININGD_* / NOTIFY_SOCKET settings reach the daemon.
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("TRAININGD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
        }
        # The repository root on the path lets the ranks import a test job (`GATED_JOB`).
        path = os.pathsep.join(p for p in (str(REPO), inherited.get("PYTHONPATH")) if p)
        # The memory tier lives beside the logs, never in the machine's real /dev/shm.
        memory = {"TRAININGD_MEMORY_DIR": str(workdir / f"{name}-shm")}
        full_env = {
            **inherited,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path,
            **memory,
            **(env or {}),
        }
        cmd = [*TRAININGD_COMMAND, "run", "--metrics-port", "0", "--log-format", "json", *args]
        with open(self.stderr_path, "wb") as err, open(self.stdout_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, env=full_env, start_new_session=True, cwd=cwd
            )
        self.pid = self.proc.pid

    # --- logs ------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """Every JSON log line written so far (torch's own C++ lines are skipped)."""
        out = []
        for line in self.stderr_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def find(self, event: str) -> list[dict[str, Any]]:
        """Log events named `event`."""
        return [e for e in self.events() if e.get("event") == event]

    def logs(self) -> str:
        """Both output streams, for assertion messages."""
        return (
            self.stdout_path.read_text(errors="replace")
            + self.stderr_path.read_text(errors="replace")[-6000:]
        )

    # --- metrics -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL of the metrics server (waits for the start-up log line)."""
        started = wait_for(lambda: self.find("daemon_started"), 60, "daemon_started")
        return str(started[0]["metrics"]).removesuffix("/metrics")

    def get(self, path: str) -> tuple[int, str]:
        """GET `path` on the daemon's server."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def scrape(self) -> Samples:
        """Parse `/metrics` with prometheus_client's parser."""
        code, text = self.get("/metrics")
        assert code == 200, text
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), s.value))
        return samples

    def values(self, name: str, **labels: str) -> list[float]:
        """Values of sample `name` in the series matching `labels` (none while unreachable)."""
        try:
            samples = self.scrape().get(name, [])
        except (OSError, AssertionError):
            return []
        return [v for lab, v in samples if all(lab.get(k) == x for k, x in labels.items())]

    def max_value(self, name: str, **labels: str) -> float:
        """Largest value of sample `name` among series matching `labels` (0 when absent)."""
        return max(self.values(name, **labels), default=0.0)

    # --- lifecycle ---------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Send `sig` to the daemon process only (as systemd's KillMode=mixed does)."""
        os.kill(self.pid, sig)

    def exit_code(self) -> int | None:
        """The exit code, or None while the daemon runs."""
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int:
        """Wait for exit; returns the exit code."""
        return self.proc.wait(timeout=timeout_s)

    def rank_pids(self) -> list[int]:
        """Rank processes of this daemon (`rank_pids_of` its session)."""
        return rank_pids_of(self.pid)

    def fork_server_pid(self) -> int:
        """The pid of the daemon's rank fork server (from its start-up log line)."""
        started = wait_for(lambda: self.find("fork_server_started"), 120, "fork_server_started")
        return int(started[0]["pid"])

    def cleanup(self, *, leave_semaphores: bool = False) -> None:
        """Kill whatever is left of the run (test teardown), and unlink the named semaphores
        the daemon held, which its killed resource tracker would have ([Note: a group SIGKILL
        leaves multiprocessing's semaphores] in `daemon/agent/semaphores.py`), unless
        `leave_semaphores` (a test of their reclaim)."""
        held = {} if leave_semaphores else held_semaphores(maps=Path(f"/proc/{self.pid}/maps"))
        for pid in session_pids(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        unlink_named(held)


class Gate:
    """Holds the ranks of a `GATED_JOB` run after `after_steps` steps until `open()`.

    Args:
        directory: the gate's directory (created).
        after_steps: optimizer steps every rank completes before it is held.
        batch_size: the run's `--batch-size` (one micro-batch per step).
        later_samples: for gate generations 1, 2, ...: samples each rank fetches before it is
            held again (steps x batch size x micro-batches at that generation's world size).
        hold_restarts: hold groups the agent restarted too (`_gated_job.GATE_RESTARTS_ENV`).
    """

    def __init__(
        self,
        directory: Path,
        *,
        after_steps: int,
        batch_size: int,
        later_samples: tuple[int, ...] = (),
        hold_restarts: bool = False,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        counts = (after_steps * batch_size, *later_samples)
        self.env = {
            _gated_job.GATE_DIR_ENV: str(directory),
            _gated_job.GATE_AFTER_SAMPLES_ENV: ",".join(str(n) for n in counts),
            **({_gated_job.GATE_RESTARTS_ENV: "1"} if hold_restarts else {}),
        }
        """Environment for `DaemonProc(env=...)`."""

    def wait_until_held(
        self, world_size: int, *daemons: DaemonProc, timeout_s: float, generation: int = 0
    ) -> None:
        """Wait until ranks 0..`world_size`-1 are all held; fail early if a daemon exits."""

        def held() -> bool:
            for d in daemons:
                assert d.exit_code() is None, f"exited with {d.exit_code()}:\n{d.logs()}"
            markers = [
                _gated_job.held_marker(self.directory, r, generation) for r in range(world_size)
            ]
            return all(m.exists() for m in markers)

        wait_for(held, timeout_s, f"{world_size} ranks held at gate generation {generation}")

    def open(self, generation: int = 0) -> None:
        """Let the ranks held at `generation` (and any that arrive later) go on."""
        _gated_job.open_marker(self.directory, generation).touch()


def ckptctl_list(root: Path) -> list[dict[str, Any]]:
    """The committed steps' rows of `ckptctl list --json` under a checkpoint root, by step."""
    out = subprocess.run(
        [str(CKPTCTL), "list", str(root), "--json"], capture_output=True, text=True, check=True
    )
    rows = json.loads(out.stdout)
    rows = rows.get("steps", rows) if isinstance(rows, dict) else rows
    committed = [r for r in rows if r.get("state", "committed") == "committed"]
    return sorted(committed, key=lambda r: int(r["step"]))


def committed_steps(root: Path) -> list[int]:
    """Committed steps under a checkpoint root, via `ckptctl list --json`."""
    return [int(r["step"]) for r in ckptctl_list(root)]


def ckptctl_restore(root: Path, step: int, out: Path, *extra: str) -> None:
    """`ckptctl restore ROOT STEP --to OUT [extra]`, run in this process.

    The same entry point as the console script, without a second interpreter importing torch
    (the restore path needs it); `tests/ckpt_manager/ctl` covers the script itself.
    """
    from ckpt_manager.ctl.cli import main

    code = main(["restore", str(root), str(step), "--to", str(out), *extra])
    assert code == 0, f"ckptctl restore {root} {step} exited {code}"
