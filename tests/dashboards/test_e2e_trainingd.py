"""End to end: a real `trainingd run`, a real Prometheus scraping it, every dashboard query.

The `trainingd` console script trains the default job on 2 local ranks with frequent
checkpoints and its metrics on a free loopback port (read from its `daemon_started` log event).
A `prometheus` on 127.0.0.1 scrapes it every second with the recording and alert rules loaded.
Once the run has trained and committed a checkpoint, every variable, panel and annotation query
of every dashboard (variables substituted: *All*, then the first value of each) must return at
least one series, every rule must evaluate cleanly, and the daemon's own `/metrics` must carry
every family the dashboards and rules read. Then the run is stopped with SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboards import _promql as promql
from tests.dashboards._evaluate import evaluate_dashboards
from tests.dashboards._prometheus import PrometheusServer

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.timeout(420)]

TRAININGD = pathlib.Path(sys.executable).parent / "trainingd"
NPROC = 2
START_TIMEOUT_S = 120.0
DATA_TIMEOUT_S = 150.0
STOP_TIMEOUT_S = 90.0


class Daemon:
    """One `trainingd run` subprocess in its own session, output in `log_path`."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "trainingd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [
            str(TRAININGD),
            "run",
            f"--nproc-per-node={NPROC}",
            # Far more steps than the test needs: it stops the run itself once checked.
            "--max-steps=100000",
            "--ckpt-every=5",
            f"--ckpt-uri={self.workdir / 'ckpt'}",
            f"--run-dir={self.workdir / 'run'}",
            "--metrics-host=127.0.0.1",
            "--metrics-port=0",
            "--publish-interval-s=0.2",
            "--log-format=json",
            "--max-restarts=0",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics_url(self, timeout_s: float) -> str:
        """The `/metrics` URL from the `daemon_started` event."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and event.get("event") == "daemon_started":
                        return str(event["metrics"])
            if self.proc.poll() is not None:
                pytest.fail(f"trainingd exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            time.sleep(0.25)
        pytest.fail(f"no daemon_started event after {timeout_s} s:\n{self.log()[-6000:]}")

    def stop(self) -> int | None:
        """SIGTERM (final checkpoint), then SIGKILL of the whole session on timeout."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Any straggler of this run's session (worker, writer) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def daemon(workdir: pathlib.Path) -> Iterator[Daemon]:
    assert TRAININGD.exists(), f"{TRAININGD} missing: is the package installed in this venv?"
    d = Daemon(workdir)
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def prom(daemon: Daemon, workdir: pathlib.Path) -> Iterator[PrometheusServer]:
    url = daemon.metrics_url(START_TIMEOUT_S)
    target = url.removeprefix("http://").split("/", 1)[0]
    prom_dir = workdir / "prometheus"
    prom_dir.mkdir()
    with PrometheusServer(prom_dir, [target], rule_files=promql.RULE_FILES) as server:
        _wait_for_training_and_a_commit(server, daemon)
        yield server


def _wait_for_training_and_a_commit(server: PrometheusServer, daemon: Daemon) -> None:
    """Until the run has a step rate and a committed checkpoint; fails early if it died."""
    assert daemon.proc is not None
    wanted = (
        'sum(trainingd_ckpt_saves_total{result="committed"}) > 0',
        "sum(rate(trainingd_train_steps_total[30s])) > 0",
    )
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while not all(server.query(expr) for expr in wanted):
        code = daemon.proc.poll()
        if code is not None or time.monotonic() > deadline:
            why = f"exited with {code}" if code is not None else f"no data after {DATA_TIMEOUT_S} s"
            pytest.fail(f"trainingd {why}; waiting for {wanted}\n{daemon.log()[-6000:]}")
        time.sleep(0.5)


def test_every_dashboard_query_returns_data_from_a_real_run(
    prom: PrometheusServer, daemon: Daemon
) -> None:
    # Recording rules need an evaluation after their inputs exist; retry until all answer.
    deadline = time.monotonic() + 60
    while True:
        variables, outcomes = evaluate_dashboards(prom, rate_interval="1m", range_="1h")
        empty = [o for o in outcomes if o.error or o.num_series < 1]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for uid, found in variables.items():
        assert found["job"] == ["trainingd"], uid
        assert len(found["run_id"]) == 1, uid
        assert len(found["instance"]) == 1, uid
        assert found["rank"] == [str(r) for r in range(NPROC)], uid
    assert not empty, "queries without data:\n" + "\n".join(o.describe() for o in empty)


def test_rules_evaluate_cleanly_against_a_real_run(prom: PrometheusServer) -> None:
    rules = prom.rules()
    assert len(rules) == sum(len(promql.rules(p)) for p in promql.RULE_FILES)
    broken = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] == "err"]
    assert not broken, broken


def test_the_daemon_exports_every_family_the_dashboards_and_rules_read(
    prom: PrometheusServer, daemon: Daemon
) -> None:
    url = daemon.metrics_url(START_TIMEOUT_S)
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    exported = {f.name for f in text_string_to_metric_families(text) if f.samples}
    read: set[str] = set()
    for path in promql.dashboard_paths():
        board = promql.load_json(path)
        texts = [q.expr for q in promql.queries(board)]
        texts += [v.selector for v in promql.label_values_variables(board)]
        read |= {n for t in texts for n in promql.metric_names(t)}
    for rule_file in promql.RULE_FILES:
        read |= {n for r in promql.rules(rule_file) for n in promql.metric_names(r["expr"])}
    families = {f.name for n in read if (f := promql.catalog_family(n)) is not None}
    # The parser names counter families without `_total`.
    missing = sorted(f for f in families if f.removesuffix("_total") not in exported)
    assert not missing, f"families without samples in the daemon's /metrics: {missing}"
