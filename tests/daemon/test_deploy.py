"""The deployment files agree with the daemon: real config keys, budgets that cover a final save."""

from __future__ import annotations

import configparser
import tomllib
from pathlib import Path

import yaml

from daemon._config_load import load_config
from daemon.config import DaemonConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(DEPLOY / "systemd" / "trainingd.service")
    return parser


def _seconds(value: str) -> float:
    return float(value.removesuffix("s"))


def test_systemd_unit_lets_the_daemon_drive_shutdown() -> None:
    service = _unit()["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["KillMode"] == "mixed"
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2"  # config errors never restart
    assert "trainingd run" in service["ExecStart"]
    assert _seconds(service["WatchdogSec"]) > 0
    # The stop timeout covers the daemon's own final-save budget.
    assert _seconds(service["TimeoutStopSec"]) > DaemonConfig().launch.shutdown_timeout_s


def _docs() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_kubernetes_manifests_use_real_keys_and_cover_the_final_save(tmp_path: Path) -> None:
    docs = _docs()
    assert {"ConfigMap", "Secret", "Service", "Job", "PodMonitor"} <= set(docs)
    toml_text = docs["ConfigMap"]["data"]["trainingd.toml"]
    path = tmp_path / "trainingd.toml"
    path.write_text(toml_text)
    cfg = load_config({}, env={"TRAININGD_NODE_RANK": "1"}, file=path)  # every key is real
    assert cfg.launch.node_rank == 1
    assert tomllib.loads(toml_text)["observability"]["metrics_port"] == 9464

    job = docs["Job"]["spec"]
    assert job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > cfg.launch.shutdown_timeout_s
    container = pod["containers"][0]
    assert container["command"][:2] == ["trainingd", "run"]  # exec form: PID 1 gets SIGTERM
    port = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert port == cfg.observability.metrics_port
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env_names = {e["name"] for e in container["env"]}
    assert "TRAININGD_NODE_RANK" in env_names
    assert container["envFrom"][0]["secretRef"]["name"] == docs["Secret"]["metadata"]["name"]

    service = docs["Service"]["spec"]
    assert service["clusterIP"] == "None"
    assert pod["subdomain"] == docs["Service"]["metadata"]["name"]
    rdzv_port = int(cfg.launch.rdzv_endpoint.rsplit(":", 1)[1])
    assert rdzv_port in {p["port"] for p in service["ports"]}
    endpoint = docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint == {**endpoint, "port": "metrics", "path": "/metrics"}
