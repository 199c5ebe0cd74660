"""End to end: a real `trainingd run`, a real Prometheus scraping it, every dashboard query.

The `trainingd` console script trains the default job on 2 local ranks with frequent
checkpoints and validations (`--val-data`, `--eval-every`) and its metrics on a free loopback
port (read from its `daemon_started` log event). A `prometheus` on 127.0.0.1 scrapes it every
second with the recording and alert rules loaded.
Once the run has trained and committed a checkpoint, every variable, panel and annotation query
of every dashboard (variables substituted: *All*, then the first value of each) must return at
least one series, every rule must evaluate cleanly, and the daemon's own `/metrics` must carry
every family the dashboards and rules read, within the series budget (at most 60 per rank).
The run is on the CPU (`--device cpu`, so the test means the same on a GPU machine) with a
configured `--peak-flops`, so MFU is exported; the GPU memory series cannot exist on a CPU rank
and are the only ones exempt (`GPU_ONLY`; on CUDA, `bench/gpu_check.py` checks them).

Then the same Prometheus watches real incidents of that run (each test builds on the one
before, sharing the set-up; the run uses `max_inflight_reductions=64`, above its bucket count):
1. one rank is SIGKILLed: the elastic agent restarts the group, and exactly one alert fires for
   the run (not one per rank);
2. the daemon is drained (SIGTERM) and a new one started on the same port, checkpoint root and
   run (`max_inflight_reductions=1`): no critical alert is pending or firing at any moment;
3. the queue-depth series follow the bound: with a bound of 1 every rank's per-step reduce peak
   sits at the bound and every issue at depth 1; with 64 the peak/bound ratio is far lower.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.agent.semaphores import held_semaphores, unlink_named
from daemon.data import write_token_file
from daemon.metrics import CATALOG
from tests.dashboards import _promql as promql
from tests.dashboards._evaluate import evaluate_dashboards
from tests.dashboards._prometheus import PrometheusServer
from tests.support.dist import free_port

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.timeout(420),
]

TRAININGD = pathlib.Path(sys.executable).parent / "trainingd"
NPROC = 2
START_TIMEOUT_S = 120.0
DATA_TIMEOUT_S = 150.0
STOP_TIMEOUT_S = 90.0


SERIES_PER_RANK_MAX = 60
FIRST_BOUND = 64
"""`max_inflight_reductions` of the first run: above the default GPT's bucket count."""
ALERT_TIMEOUT_S = 120.0
GPU_ONLY = frozenset(
    {
        "trainingd_gpu_memory_allocated_bytes",
        "trainingd_gpu_memory_reserved_bytes",
        "trainingd_gpu_memory_max_allocated_bytes",
    }
)
"""Families a CPU rank never exports (CUDA allocator figures): exempt from "returns data"."""


class Daemon:
    """One `trainingd run` subprocess in its own session, output in `log_path`."""

    def __init__(
        self, workdir: pathlib.Path, *, port: int, bound: int, name: str = "trainingd"
    ) -> None:
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.port = port
        self.bound = bound
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Validation data (random bytes, the default GPT's vocabulary), so the validation loss
        # family has values by the first checkpoint (`--eval-every` = `--ckpt-every`).
        val = self.workdir / "val.bin"
        if not val.exists():
            tokens = np.random.default_rng(0).integers(0, 256, 4096)
            write_token_file(str(val), [tokens], vocab_size=256)
        args = [
            str(TRAININGD),
            "run",
            f"--nproc-per-node={NPROC}",
            # Far more steps than the test needs: it stops the run itself once checked.
            "--max-steps=100000",
            "--ckpt-every=5",
            f"--val-data={val}",
            "--eval-every=5",
            "--eval-batches=1",
            f"--ckpt-uri={self.workdir / 'ckpt'}",
            f"--run-dir={self.workdir / 'run'}",
            "--metrics-host=127.0.0.1",
            # A fixed port: the restarted daemon is the same scrape target.
            f"--metrics-port={self.port}",
            "--publish-interval-s=0.2",
            "--log-format=json",
            # One restart allowed: the SIGKILL test needs the group to come back.
            "--max-restarts=1",
            f"--max-inflight-reductions={self.bound}",
            "--device=cpu",
            # The CPU has no peak in the table: a configured one makes MFU exist.
            "--peak-flops=1e11",
        ]
        # The memory tier beside the logs, never in the machine's /dev/shm: `kill()` leaves it.
        shm = str(self.workdir / "shm")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAININGD_MEMORY_DIR": shm}
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
                self.kill()
        # Any straggler of this run's session (worker, writer) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL at once, for a teardown that checks nothing of the ending: the ranks see
        their daemon gone and kill their own groups (tested in tests/daemon/test_e2e.py). The
        named semaphores the daemon held are unlinked after it, as its killed resource tracker
        would have ([Note: a group SIGKILL leaves multiprocessing's semaphores] in
        `daemon/agent/semaphores.py`)."""
        if self.proc is None:
            return
        held = held_semaphores(maps=pathlib.Path(f"/proc/{self.proc.pid}/maps"))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        unlink_named(held)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def daemon(workdir: pathlib.Path) -> Iterator[Daemon]:
    assert TRAININGD.exists(), f"{TRAININGD} missing: is the package installed in this venv?"
    d = Daemon(workdir, port=free_port(), bound=FIRST_BOUND)
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
        empty = [
            o
            for o in outcomes
            if o.error or (o.num_series < 1 and not promql.metric_names(o.query.expr) <= GPU_ONLY)
        ]
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
    missing = sorted(
        f for f in families if f.removesuffix("_total") not in exported and f not in GPU_ONLY
    )
    assert not missing, f"families without samples in the daemon's /metrics: {missing}"


def test_only_the_gpu_family_is_exempt() -> None:
    gpu_family = {s.name for s in CATALOG if s.name.startswith("trainingd_gpu_")}
    assert gpu_family == GPU_ONLY


# --- series budget ------------------------------------------------------------------------------
def _scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("trainingd_")
    ]


@pytest.fixture(scope="module")
def first_scrape(prom: PrometheusServer, daemon: Daemon) -> list[tuple[str, dict[str, str], float]]:
    """A scrape of the first run once every rank has published a step's queue peaks."""
    url = daemon.metrics_url(START_TIMEOUT_S)
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        samples = _scrape(url)
        peaks = [s for s in samples if s[0] == "trainingd_fsdp_queue_depth_step_peak"]
        if len(peaks) == 2 * NPROC or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_series_per_rank_stay_within_budget(
    first_scrape: list[tuple[str, dict[str, str], float]],
) -> None:
    per_rank = collections.Counter(lab["rank"] for _, lab, _ in first_scrape if "rank" in lab)
    node = sum(1 for _, labels, _ in first_scrape if "rank" not in labels)
    print(f"series: {dict(per_rank)} per rank, {node} per node, {len(first_scrape)} in all")
    assert sorted(per_rank) == [str(r) for r in range(NPROC)]
    assert max(per_rank.values()) <= SERIES_PER_RANK_MAX, per_rank
    # Every series says which run it belongs to, and there is one run.
    assert {labels.get("run_id") for _, labels, _ in first_scrape} == {first_scrape[0][1]["run_id"]}
    # Job values come once per node, not once per rank.
    assert sum(1 for name, _, _ in first_scrape if name == "trainingd_train_loss") == 1


def test_every_log_event_names_the_run(
    daemon: Daemon, first_scrape: list[tuple[str, dict[str, str], float]]
) -> None:
    # The run_id label of the metrics is bound into every structured log record (daemon and
    # ranks), so an alert's run_id finds the run's log lines.
    events = []
    for line in daemon.log().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and "event" in event:
                events.append(event)
    # Both the daemon's own events and the ranks' (checkpoint_scheduled) are there.
    assert any(e.get("role") == "daemon" for e in events), events
    assert any("rank" in e for e in events), events
    run_id = first_scrape[0][1]["run_id"]
    missing = sorted({e["event"] for e in events if e.get("run_id") != run_id})
    assert not missing, f"log events without the run's run_id: {missing}"


# --- real alerts -----------------------------------------------------------------------------
def _alerts(prom: PrometheusServer, selector: str = "") -> list[dict[str, str]]:
    return [r["metric"] for r in prom.query(f"ALERTS{{{selector}}}")]


def _rank_pid(workdir: pathlib.Path, local_rank: int) -> int:
    data = json.loads((workdir / "run" / "ranks" / f"local-{local_rank}.json").read_text())
    return int(data["pid"])


@pytest.fixture(scope="module")
def killed(
    prom: PrometheusServer, daemon: Daemon, workdir: pathlib.Path, first_scrape: object
) -> list[dict[str, str]]:
    """SIGKILL local rank 1; every firing alert a few evaluations after the restart's."""
    assert daemon.proc is not None
    victim = _rank_pid(workdir, 1)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    # Until the restart is reported; whatever else fires meanwhile stays in ALERTS.
    while not _alerts(prom, 'alertstate="firing", alertname="TrainingdWorkersRestarted"'):
        if daemon.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no alert after SIGKILL of rank pid {victim}:\n{daemon.log()[-6000:]}")
        time.sleep(0.5)
    # Several more rule evaluations (1 s each): a per-rank alert would show up by now.
    time.sleep(5.0)
    return _alerts(prom, 'alertstate="firing"')


def test_killing_one_rank_fires_exactly_one_alert_for_the_run(
    killed: list[dict[str, str]], first_scrape: list[tuple[str, dict[str, str], float]]
) -> None:
    run_id = first_scrape[0][1]["run_id"]
    assert len(killed) == 1, killed
    (alert,) = killed
    assert alert["run_id"] == run_id
    assert alert["alertname"] == "TrainingdWorkersRestarted"
    assert "rank" not in alert
    assert "instance" not in alert


@dataclasses.dataclass
class Restarted:
    daemon: Daemon
    critical_seen: list[dict[str, str]]
    scrape: list[tuple[str, dict[str, str], float]]
    target_seen_down: bool


@pytest.fixture(scope="module")
def restarted(
    prom: PrometheusServer,
    daemon: Daemon,
    workdir: pathlib.Path,
    killed: object,
) -> Iterator[Restarted]:
    """Drain the first daemon, start a second on the same port and run, with bound 1."""
    critical: list[dict[str, str]] = []

    def watch() -> None:
        critical.extend(_alerts(prom, 'severity="critical"'))

    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while daemon.proc.poll() is None and time.monotonic() < deadline:
        watch()
        time.sleep(0.5)
    assert daemon.stop() == 143, daemon.log()[-6000:]
    second = Daemon(workdir, port=daemon.port, bound=1, name="trainingd-2")
    second.start()
    try:
        assert second.proc is not None
        url = second.metrics_url(START_TIMEOUT_S)
        deadline = time.monotonic() + DATA_TIMEOUT_S
        # Until the new run has stepped on every rank and Prometheus has seen it train.
        while True:
            watch()
            samples = _scrape(url)
            peaks = [v for n, _, v in samples if n == "trainingd_fsdp_queue_depth_step_peak"]
            training = prom.query("sum(rate(trainingd_train_steps_total[10s])) > 0")
            if len(peaks) == 2 * NPROC and training:
                break
            if second.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"second run did not train:\n{second.log()[-6000:]}")
            time.sleep(0.5)
        for _ in range(6):  # a few more evaluations with the new daemon up
            watch()
            time.sleep(0.5)
        # The gap between the two daemons was scraped as down: the test did exercise it.
        gap = prom.query('min_over_time(up{job="trainingd"}[5m])')
        yield Restarted(
            daemon=second,
            critical_seen=critical,
            scrape=samples,
            target_seen_down=[float(r["value"][1]) for r in gap] == [0.0],
        )
    finally:
        second.kill()  # nothing reads its ending: no final checkpoint to wait for


def test_a_drained_and_restarted_run_raises_no_critical_alert(restarted: Restarted) -> None:
    # Prometheus saw the target down between the daemons (TrainingdDaemonDown's input), yet
    # no critical alert was ever pending: the drained daemon's last scrape said finished.
    assert restarted.target_seen_down
    assert restarted.critical_seen == []


# --- queue depth under load --------------------------------------------------------------------
def _reduce_fill(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """Per rank: the last step's reduce peak / the reduce bound."""
    (bound,) = [
        v for n, lab, v in samples if n == "trainingd_fsdp_queue_bound" and lab["queue"] == "reduce"
    ]
    return {
        lab["rank"]: v / bound
        for n, lab, v in samples
        if n == "trainingd_fsdp_queue_depth_step_peak" and lab["queue"] == "reduce"
    }


def test_queue_depth_series_follow_the_bound(
    first_scrape: list[tuple[str, dict[str, str], float]], restarted: Restarted
) -> None:
    tight, loose = _reduce_fill(restarted.scrape), _reduce_fill(first_scrape)
    print(f"reduce peak/bound: bound 1 -> {tight}, bound {FIRST_BOUND} -> {loose}")
    assert sorted(tight) == sorted(loose) == [str(r) for r in range(NPROC)]
    # Bound 1: every step fills the queue; bound 64: the model's buckets never get near it.
    assert set(tight.values()) == {1.0}
    assert max(loose.values()) < 0.5
    assert min(loose.values()) > 0  # but reductions did overlap
    # Every issue of the bound-1 run found the queue at depth 1 (the bucket le="1.0" is all).
    buckets = {
        (lab["rank"], lab["le"]): v
        for n, lab, v in restarted.scrape
        if n == "trainingd_fsdp_queue_issue_depth_bucket" and lab["queue"] == "reduce"
    }
    for rank in tight:
        assert buckets[rank, "1.0"] == buckets[rank, "+Inf"] > 0
