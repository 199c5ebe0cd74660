"""The deployment files agree with the daemon: real config keys, budgets that cover a final save.

The Kubernetes manifests are also validated offline against the core API schemas that
`kubernetes-validate` bundles (no network, no cluster), pinned to `K8S_VERSION`.
"""

from __future__ import annotations

import configparser
import re
import shutil
import socket
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
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
    assert service["SuccessExitStatus"] == "143"  # stopped here by systemctl: done, no restart
    assert service["RestartForceExitStatus"] == "75"  # a peer's stop ended the run: rejoin
    assert "trainingd run" in service["ExecStart"]
    assert _seconds(service["WatchdogSec"]) > 0
    # The stop timeout covers the daemon's own final-save budget.
    assert _seconds(service["TimeoutStopSec"]) > DaemonConfig().launch.shutdown_timeout_s
    # Waiting for peers moves nothing on this node, so no EXTEND_TIMEOUT_USEC goes out then:
    # the start timeout itself covers the rendezvous timeout, with room for build and restore.
    assert _seconds(service["TimeoutStartSec"]) >= 2 * DaemonConfig().launch.rdzv_timeout_s


def _docs() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


_BUDGET_KEYS = {
    "build": "trainingd.example.com/build-budget-seconds",
    "restore": "trainingd.example.com/restore-budget-seconds",
}


def _probe_budget_s(probe: dict[str, Any]) -> int:
    """How long a probe may fail before Kubernetes acts (the API's defaults: 10 s x 3)."""
    return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))


def _check_pod_budgets(pod: dict[str, Any], configmap: dict[str, Any], tmp_path: Path) -> None:
    """startupProbe > rendezvous + build + restore; liveness as patient as the heartbeat."""
    path = tmp_path / "budget.toml"
    path.write_text(configmap["data"]["trainingd.toml"])
    cfg = load_config({}, env={"TRAININGD_NODE_RANK": "0"}, file=path)
    annotations = configmap["metadata"]["annotations"]
    build_s, restore_s = (int(annotations[key]) for key in _BUDGET_KEYS.values())
    assert build_s > 0
    assert restore_s > 0
    container = pod["containers"][0]
    start_s = _probe_budget_s(container["startupProbe"])
    assert start_s > cfg.launch.rdzv_timeout_s + build_s + restore_s
    # Conservative liveness: a restart of one pod restarts the gang, so it takes /healthz
    # failing for at least as long as the heartbeat timeout behind it.
    liveness = container["livenessProbe"]
    assert liveness["failureThreshold"] >= 3
    assert _probe_budget_s(liveness) >= cfg.observability.heartbeat_timeout_s
    assert pod["securityContext"]
    assert container["securityContext"]


_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_QUANTITY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3,
                   "M": 10**6, "G": 10**9, "T": 10**12, None: 1}  # fmt: skip


def _quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (`16Gi`, `500M`, `1024`) in bytes."""
    match = _QUANTITY.match(str(quantity))
    assert match, f"unsupported quantity {quantity!r}: extend _quantity_bytes"
    return int(match.group(1)) * _QUANTITY_UNITS[match.group(2)]


def _memory_dir() -> str:
    """`memory_dir` as the ConfigMap sets it (the default if it does not; its keys are checked
    with the real loader in the test below)."""
    text = _docs()["ConfigMap"]["data"]["trainingd.toml"]
    default = DaemonConfig().checkpoint.memory_dir
    return str(tomllib.loads(text).get("checkpoint", {}).get("memory_dir", default))


def _check_memory_tier(pod: dict[str, Any], memory_dir: str) -> None:
    """memory_dir is an in-memory emptyDir, whose sizeLimit the pod's memory limit covers."""
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == memory_dir)
    assert not mount.get("readOnly", False)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"  # tmpfs: RAM, not the node's disk
    size = _quantity_bytes(volume["emptyDir"]["sizeLimit"])
    limit = _quantity_bytes(container["resources"]["limits"]["memory"])
    # tmpfs pages are charged to the pod's memory cgroup: the limit must hold them and more.
    assert 0 < size < limit, (size, limit)


def test_memory_quantities_parse_and_the_check_catches_an_oversized_tier() -> None:
    assert _quantity_bytes("16Gi") == 16 << 30
    assert _quantity_bytes("500M") == 500 * 10**6
    pod = _docs()["Job"]["spec"]["template"]["spec"]
    _check_memory_tier(pod, "/dev/shm")
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    shm["emptyDir"]["sizeLimit"] = "65Gi"  # more than the 64Gi limit
    with pytest.raises(AssertionError):
        _check_memory_tier(pod, "/dev/shm")
    with pytest.raises(StopIteration):  # memory_dir somewhere no volume is mounted
        _check_memory_tier(pod, "/mnt/elsewhere")


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
    assert job["completions"] == job["parallelism"] == int(cfg.launch.nnodes)  # one pod per node
    pod = job["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > cfg.launch.shutdown_timeout_s
    _check_pod_budgets(pod, docs["ConfigMap"], tmp_path)
    _check_memory_tier(pod, cfg.checkpoint.memory_dir)
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

    rules = docs["Job"]["spec"]["podFailurePolicy"]["rules"]
    by_code = {r["onExitCodes"]["values"][0]: r["action"] for r in rules if "onExitCodes" in r}
    assert by_code == {2: "FailJob", 75: "Ignore"}  # only exit 0 (max_steps) completes a pod

    service = docs["Service"]["spec"]
    assert service["clusterIP"] == "None"
    assert pod["subdomain"] == docs["Service"]["metadata"]["name"]
    rdzv_port = int(cfg.launch.rdzv_endpoint.rsplit(":", 1)[1])
    assert rdzv_port in {p["port"] for p in service["ports"]}
    endpoint = docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint == {**endpoint, "port": "metrics", "path": "/metrics"}


def test_kubernetes_pods_are_restricted_and_apply_never_overwrites_the_secret() -> None:
    docs = _docs()
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    applied = {
        doc["kind"]
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text())
    }
    assert "Secret" not in applied  # `kubectl apply -k` must not replace real credentials
    assert "ServiceAccount" in applied

    pod = docs["Job"]["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False  # no TRAININGD_* variables from Services
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["envFrom"][0]["secretRef"]["optional"] is False
    # With a read-only root, everything the daemon writes is a volume.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    for writable in (env["TRAININGD_RUN_DIR"], "/tmp", "/dev/shm", env["HOME"]):
        assert writable in mounts, writable
        assert not mounts[writable].get("readOnly", False)


# --- the systemd sandbox (`systemd-analyze`, from Debian's `systemd` package) -----------------
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.systemd
def test_systemd_unit_exposure_is_at_most_4(tmp_path: Path) -> None:
    unit = tmp_path / "trainingd.service"
    unit.write_text((DEPLOY / "systemd" / "trainingd.service").read_text())
    out = subprocess.run(
        [str(SYSTEMD_ANALYZE), "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Overall exposure level for trainingd\.service: ([0-9.]+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= 4.0, out.stdout


@pytest.mark.systemd
def test_systemd_unit_verifies_clean(tmp_path: Path) -> None:
    # The unit names the installed binary (/opt/trainingd/...); verify checks that it exists and
    # is executable, so this copy points at a stand-in with the same role.
    stand_in = tmp_path / "trainingd"
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    text = (DEPLOY / "systemd" / "trainingd.service").read_text()
    assert "/opt/trainingd/.venv/bin/trainingd run" in text
    unit = tmp_path / "trainingd.service"
    unit.write_text(text.replace("/opt/trainingd/.venv/bin/trainingd", str(stand_in)))
    out = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert not out.stderr.strip(), out.stderr


def test_systemd_sandbox_leaves_the_checkpoint_root_and_run_dir_writable() -> None:
    service = _unit()["Service"]
    assert service["ProtectSystem"] == "strict"  # everything else is read-only
    state = Path("/var/lib") / service["StateDirectory"]
    assert Path(service["WorkingDirectory"]) == state
    cfg = DaemonConfig()
    # The default checkpoint root is relative: it lands in the writable state directory. The
    # per-run directory defaults to a temporary one: the unit's private /tmp.
    assert not Path(cfg.checkpoint.ckpt_uri).is_absolute()
    assert cfg.launch.run_dir == ""
    assert service["RuntimeDirectory"] == "trainingd"  # /run/trainingd, per-run scratch
    assert service["PrivateTmp"] == "yes"
    assert service["NoNewPrivileges"] == "yes"
    assert service["CapabilityBoundingSet"] == ""


# --- the container image and the JobSet example -------------------------------------------------
ROOT = DEPLOY.parent


def test_dockerfile_builds_an_unprivileged_image_of_this_repo() -> None:
    # No container builder runs on the development machine or CI (no daemon, no registry
    # access), so the image's structure is checked here; README gives the build command.
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line and not line.startswith("#")]
    froms = [line for line in lines if line.startswith("FROM ")]
    assert len(froms) == 2  # build stage + slim runtime stage
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_PIN := torch==(\S+)$", makefile, re.M)
    assert torch_pin
    assert f"ARG TORCH_VERSION={torch_pin.group(1)}" in lines
    for package in ("sharding", "ckpt_manager", "daemon"):
        assert f"COPY {package} ./{package}" in lines
    job_pod = _docs()["Job"]["spec"]["template"]["spec"]
    uid = job_pod["securityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in lines  # the pods' runAsUser owns nothing else
    assert 'ENTRYPOINT ["trainingd"]' in lines  # exec form: the daemon is PID 1
    assert lines[-1] == 'CMD ["run", "--config", "/etc/trainingd/trainingd.toml"]'
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[1] == "*"  # an allow-list: no .venv, tests or checkpoints in the context
    assert {"!sharding/", "!ckpt_manager/", "!daemon/", "!pyproject.toml"} <= set(ignore)


def test_jobset_example_runs_the_same_pods_with_gang_restart(tmp_path: Path) -> None:
    jobset = yaml.safe_load((DEPLOY / "kubernetes" / "jobset" / "jobset.yaml").read_text())
    kustomization = yaml.safe_load(
        (DEPLOY / "kubernetes" / "jobset" / "kustomization.yaml").read_text()
    )
    assert kustomization["resources"] == ["jobset.yaml"]  # the Secret is never applied
    spec = jobset["spec"]
    assert spec["failurePolicy"]["maxRestarts"] > 0
    assert spec["network"]["enableDNSHostnames"] is True
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    docs = _docs()
    toml_text = docs["ConfigMap"]["data"]["trainingd.toml"]
    launch = tomllib.loads(toml_text)["launch"]
    assert job["completions"] == job["parallelism"] == int(launch["nnodes"])
    assert job["podFailurePolicy"] == docs["Job"]["spec"]["podFailurePolicy"]
    pod = job["template"]["spec"]
    _check_pod_budgets(pod, docs["ConfigMap"], tmp_path)
    _check_memory_tier(pod, _memory_dir())
    indexed_pod = docs["Job"]["spec"]["template"]["spec"]
    for key in ("securityContext", "enableServiceLinks", "serviceAccountName"):
        assert pod[key] == indexed_pod[key], key
    container, indexed = pod["containers"][0], indexed_pod["containers"][0]
    for key in ("securityContext", "command", "ports", "startupProbe", "livenessProbe"):
        assert container[key] == indexed[key], key
    env = {e["name"]: e.get("value") for e in container["env"]}
    pod0 = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{spec['network']['subdomain']}"
    port = launch["rdzv_endpoint"].rsplit(":", 1)[1]
    assert env["TRAININGD_RDZV_ENDPOINT"] == f"{pod0}:{port}"


def test_the_etcd_rendezvous_example_serves_the_v2_api_where_the_configmap_points(
    tmp_path: Path,
) -> None:
    folder = DEPLOY / "kubernetes" / "etcd"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["etcd.yaml"]
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((folder / "etcd.yaml").read_text())}
    assert set(docs) == {"Service", "StatefulSet"}
    service, sts = docs["Service"], docs["StatefulSet"]["spec"]
    assert service["spec"]["clusterIP"] == "None"
    assert sts["serviceName"] == service["metadata"]["name"]
    replicas = sts["replicas"]
    assert replicas % 2 == 1  # a quorum survives the loss of a member
    container = sts["template"]["spec"]["containers"][0]
    # torch's etcd-v2 backend speaks the v2 API: on behind the flag, and gone in etcd 3.6.
    assert "--enable-v2=true" in container["command"]
    assert re.search(r":v3\.[45]\.\d+$", container["image"]), container["image"]
    flags = dict(f.split("=", 1) for f in container["command"] if f.startswith("--"))
    members = flags["--initial-cluster"].split(",")
    assert len(members) == replicas
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    client_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")

    # The ConfigMap's etcd lines, uncommented, are a real configuration naming that Service.
    text = _docs()["ConfigMap"]["data"]["trainingd.toml"]
    start = text.index("#   nnodes")
    etcd_lines = [line.replace("#   ", "", 1) for line in text[start:].splitlines()[:3]]
    c10d = ("nnodes", "rdzv_backend", "rdzv_endpoint")
    lines = [line for line in text.splitlines() if not line.strip().startswith(c10d)]
    at = lines.index("[launch]") + 1
    path = tmp_path / "etcd.toml"
    path.write_text("\n".join([*lines[:at], *etcd_lines, *lines[at:]]))
    cfg = load_config({}, env={"TRAININGD_NODE_RANK": "1"}, file=path)
    assert cfg.launch.rdzv_backend.value == "etcd-v2"
    assert cfg.launch.elastic
    assert cfg.launch.rdzv_endpoint == f"{service['metadata']['name']}:{client_port}"


# --- offline schema validation (kubernetes-validate's bundled core schemas) -----------------
K8S_VERSION = "1.33"
"""Kubernetes release whose schemas the manifests must satisfy (podFailurePolicy is GA since
1.31; `kubernetes-validate` bundles 1.25 to 1.37, so no version is ever downloaded)."""
_NOT_CORE = {
    "kustomize.config.k8s.io/v1beta1": "a kustomize file, not an API object",
    "monitoring.coreos.com/v1": "Prometheus Operator CRD (checked structurally above)",
    "jobset.x-k8s.io/v1alpha2": "JobSet CRD: its Job templates are validated as batch/v1 Jobs",
}


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any socket connection: the validation must use only the bundled schemas."""

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"schema validation tried the network: {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def _validate(resource: dict[str, Any]) -> None:
    import kubernetes_validate

    try:
        # strict: unknown fields (a misspelt key Kubernetes would silently drop) fail too.
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        name = f"{resource['kind']}/{resource['metadata']['name']}"
        raise AssertionError(f"{name}: {err.message} at {list(err.path)}") from err


def _all_manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            yield path, doc


def test_kubernetes_manifests_validate_against_the_core_schemas_offline(no_network: None) -> None:
    validated: list[str] = []
    for path, doc in _all_manifests():
        if doc["apiVersion"] in _NOT_CORE:
            continue
        _validate(doc)
        validated.append(f"{path.name}:{doc['kind']}")
    assert {"configmap.yaml:ConfigMap", "job.yaml:Job", "service.yaml:Service"} <= set(validated)
    assert {"secret.example.yaml:Secret", "serviceaccount.yaml:ServiceAccount"} <= set(validated)
    # JobSet is a CRD with no schema in the core set: each replicated Job's template is a
    # batch/v1 JobTemplateSpec, so it is validated as the Job JobSet will create from it.
    jobsets = [doc for _, doc in _all_manifests() if doc["kind"] == "JobSet"]
    assert jobsets
    for jobset in jobsets:
        for rjob in jobset["spec"]["replicatedJobs"]:
            template = rjob["template"]
            _validate(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {
                        **template.get("metadata", {}),
                        "name": f"{jobset['metadata']['name']}-{rjob['name']}-0",
                    },
                    "spec": template["spec"],
                }
            )


def test_schema_validation_catches_a_wrong_manifest(no_network: None) -> None:
    # The check above can fail: a misspelt probe field and a string where an integer belongs.
    job = yaml.safe_load((DEPLOY / "kubernetes" / "job.yaml").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["startupProbe"]["failureTreshold"] = 90
    with pytest.raises(AssertionError, match="failureTreshold"):
        _validate(job)
    del container["startupProbe"]["failureTreshold"]
    job["spec"]["completions"] = "2"
    with pytest.raises(AssertionError, match="completions"):
        _validate(job)


# --- the GPU variants (kustomize overlays: resources + JSON 6902 patches) -------------------
# [Note: rendering the overlays without kubectl] kubectl is not in Debian's archive, so a CI
# machine may lack it; the overlays use only what `_kustomize` below understands (directories
# of `resources` and JSON 6902 `patches` with add/replace/test), so the suite renders them
# itself, and checks its rendering against `kubectl kustomize` wherever kubectl exists.
_KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "patches"}


def _kustomize(root: Path) -> list[dict[str, Any]]:
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(spec) - _KUSTOMIZE_KEYS
    assert not unknown, f"{root}: extend _kustomize for {sorted(unknown)} (or use kubectl)"
    docs: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = root / resource
        if path.is_dir():
            docs.extend(_kustomize(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for patch in spec.get("patches", []):
        target = patch["target"]
        matches = [
            d
            for d in docs
            if d["kind"] == target["kind"]
            and d["metadata"]["name"] == target["name"]
            and d["apiVersion"] == f"{target['group']}/{target['version']}"
        ]
        assert len(matches) == 1, f"{root}: patch target {target} matches {len(matches)} docs"
        for op in yaml.safe_load(patch["patch"]):
            _json_patch(matches[0], op)
    return docs


def _json_patch(doc: dict[str, Any], op: dict[str, Any]) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    index: Any = int(last) if isinstance(node, list) and last != "-" else last
    if op["op"] == "test":
        assert node[index] == op["value"], f"JSON patch test failed at {op['path']}"
    elif op["op"] == "replace":
        assert isinstance(node, list) or index in node, f"nothing to replace at {op['path']}"
        node[index] = op["value"]
    elif op["op"] == "add":
        if isinstance(node, list):
            node.insert(len(node) if index == "-" else index, op["value"])
        else:
            node[index] = op["value"]
    else:
        raise AssertionError(f"extend _json_patch for op {op['op']!r}")


def _render(overlay: str) -> list[dict[str, Any]]:
    docs = _kustomize(DEPLOY / overlay)
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        result = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        rendered = list(yaml.safe_load_all(result.stdout))
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(rendered, key=key) == sorted(docs, key=key)
    return docs


def test_offline_kustomize_applies_patches_and_refuses_what_it_does_not_know(
    tmp_path: Path,
) -> None:
    base, over = tmp_path / "base", tmp_path / "over"
    base.mkdir()
    over.mkdir()
    (base / "kustomization.yaml").write_text("resources: [thing.yaml]\n")
    (base / "thing.yaml").write_text(
        "apiVersion: example.com/v1\nkind: Thing\nmetadata: {name: t}\nspec: {a: 1, l: [x]}\n"
    )
    patch = (
        "resources: [../base]\n"
        "patches:\n- target: {group: example.com, version: v1, kind: Thing, name: NAME}\n"
        "  patch: |-\n    - {op: test, path: /spec/a, value: 1}\n"
        "    - {op: replace, path: /spec/a, value: 2}\n"
        "    - {op: add, path: /spec/l/-, value: y}\n"
    )
    (over / "kustomization.yaml").write_text(patch.replace("NAME", "t"))
    (doc,) = _kustomize(over)
    assert doc["spec"] == {"a": 2, "l": ["x", "y"]}
    (over / "kustomization.yaml").write_text(patch.replace("NAME", "other"))
    with pytest.raises(AssertionError, match="matches 0 docs"):
        _kustomize(over)
    (over / "kustomization.yaml").write_text("resources: [../base]\nnamespace: n\n")
    with pytest.raises(AssertionError, match="namespace"):
        _kustomize(over)


def _gpu_pod_checks(pod: dict[str, Any], base_pod: dict[str, Any]) -> None:
    (container,) = pod["containers"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus > 0
    command = container["command"]
    # One rank per GPU, and a node without CUDA fails its start instead of training on CPUs.
    assert command[command.index("--nproc-per-node") + 1] == str(gpus)
    assert command[command.index("--device") + 1] == "cuda"
    assert command[:4] == base_pod["containers"][0]["command"]
    cfg = load_config(
        {"nproc_per_node": str(gpus), "device": "cuda"}, env={"TRAININGD_NODE_RANK": "0"}
    )
    assert cfg.launch.nproc_per_node == gpus
    _check_memory_tier(pod, _memory_dir())
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # Everything else is the CPU pod's (probes, security, ports).
    for key in ("securityContext", "ports", "startupProbe", "livenessProbe", "env"):
        assert container[key] == base_pod["containers"][0][key], key


def test_gpu_overlays_request_one_gpu_per_rank_and_validate(no_network: None) -> None:
    docs = {doc["kind"]: doc for doc in _render("kubernetes-gpu")}
    base = _docs()
    assert set(docs) >= {"Job", "ConfigMap", "Service", "PodMonitor"}
    _gpu_pod_checks(
        docs["Job"]["spec"]["template"]["spec"], base["Job"]["spec"]["template"]["spec"]
    )
    _validate(docs["Job"])
    (jobset,) = _render("kubernetes-gpu/jobset")
    template = jobset["spec"]["replicatedJobs"][0]["template"]
    base_jobset = yaml.safe_load((DEPLOY / "kubernetes" / "jobset" / "jobset.yaml").read_text())
    base_template = base_jobset["spec"]["replicatedJobs"][0]["template"]
    _gpu_pod_checks(template["spec"]["template"]["spec"], base_template["spec"]["template"]["spec"])
    _validate(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "trainingd-nodes-0"},
            "spec": template["spec"],
        }
    )
