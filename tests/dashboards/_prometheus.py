"""A real `prometheus` server for tests: loopback only, temporary storage, our rules loaded.

`PrometheusServer(workdir, targets).start()` writes a config scraping `targets` (host:port on
127.0.0.1) every `scrape_interval_s` as job `trainingd`, loads the rule files, starts the
binary on a free loopback port and waits until it answers `/-/ready`. `query()`,
`series()` and `rules()` wrap the HTTP API; `stop()` terminates it (SIGTERM, then SIGKILL).
Its log is in `workdir/prometheus.log` and is quoted in every failure.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import yaml

from tests.support.dist import free_port

JOB = "trainingd"


class PrometheusError(RuntimeError):
    """The server did not start, or the API answered an error."""


class PrometheusServer:
    """One `prometheus` process owned by a test."""

    def __init__(
        self,
        workdir: pathlib.Path,
        targets: Sequence[str],
        *,
        rule_files: Sequence[pathlib.Path] = (),
        scrape_interval_s: int = 1,
    ) -> None:
        self.workdir = workdir
        self._targets = list(targets)
        self._rule_files = [str(p) for p in rule_files]
        self._interval = f"{scrape_interval_s}s"
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """The server's output so far."""
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        """Start the server and wait until it is ready."""
        exe = shutil.which("prometheus")
        if exe is None:
            raise PrometheusError(
                "prometheus is missing: install Debian's `prometheus` (`make test` does as root)"
            )
        config = {
            "global": {"scrape_interval": self._interval, "evaluation_interval": self._interval},
            "rule_files": self._rule_files,
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "scrape_interval": self._interval,
                    "scrape_timeout": self._interval,
                    "static_configs": [{"targets": self._targets}],
                }
            ],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        log = (self.workdir / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                exe,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                raise PrometheusError(f"prometheus exited with {code}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusError(f"prometheus not ready after {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, SIGKILL after 10 s)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- HTTP API ------------------------------------------------------------------------------
    def _api(self, path: str, params: dict[str, str] | list[tuple[str, str]]) -> Any:
        body = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/{path}", data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                payload = json.load(resp)
        except urllib.error.HTTPError as err:
            payload = json.load(err)
        if payload.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {payload.get('error')}")
        return payload["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; returns the result vector (or a one-element list for a scalar)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        if data["resultType"] in {"scalar", "string"}:
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def series(self, selector: str) -> list[dict[str, str]]:
        """Label sets of the series matching `selector` in the last hour."""
        now = time.time()
        params = [("match[]", selector), ("start", f"{now - 3600:.3f}"), ("end", f"{now:.3f}")]
        return list(self._api("series", params))

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its health and last error."""
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=10) as resp:
            groups = json.load(resp)["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def wait_for(self, expr: str, timeout_s: float) -> list[dict[str, Any]]:
        """Poll `expr` until it returns a series; raise with the server log on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"no data for {expr!r} after {timeout_s} s:\n{self.log()}")
            time.sleep(0.25)
