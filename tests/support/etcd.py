"""An etcd server on loopback for the etcd-v2 rendezvous tests.

Debian's `etcd-server` (3.4) with the v2 API on (`--enable-v2=true`: torch elastic's `etcd-v2`
backend speaks it through `python-etcd`), its data directory in the test's temporary folder, and
both its client and peer URLs on 127.0.0.1 (no traffic elsewhere). Tests that use it are marked
`etcd`; without the binary they skip with a reason (or fail in strict mode, `tests/conftest.py`).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.dist import free_port

__all__ = ["EtcdServer"]

_START_TIMEOUT_S = 30.0


class EtcdServer:
    """One single-member etcd on 127.0.0.1 with the v2 API.

    Args:
        data_dir: its data directory (created; removed with the test's tmp folder).
    """

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = data_dir
        self._log = data_dir.with_suffix(".log")
        self.port = free_port()
        self._peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        """`host:port` of its client URL (what `--rdzv-endpoint` takes)."""
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EtcdServer:
        """Start it and wait until the v2 API answers."""
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self._peer_port}"
        cmd = [
            "etcd",
            "--name", "test",
            "--data-dir", str(self._data_dir),
            "--enable-v2=true",
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self._log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd did not start on {self.endpoint}:\n{tail}")
            time.sleep(0.1)
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/v2/keys/", timeout=1) as resp:
                return bool(json.loads(resp.read()).get("action") == "get")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
