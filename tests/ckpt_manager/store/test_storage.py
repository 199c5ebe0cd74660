"""Storage contract: one suite on local disk, memory://, moto S3 and SeaweedFS."""

from __future__ import annotations

import os
import pathlib
import threading

import pytest

from ckpt_manager._format.names import validate_relative_name
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    VersionMismatchError,
)
from tests.ckpt_manager.conftest import Root

pytestmark = pytest.mark.s3


def _storage(root: Root) -> Storage:
    return Storage(root.uri, root.storage_options)


def test_write_read_roundtrip_and_ranges(backend_root: Root) -> None:
    st = _storage(backend_root)
    payload = bytes(range(256)) * 40
    st.write("step-000000000001/rank-00000.bin", payload)
    assert st.read("step-000000000001/rank-00000.bin") == payload
    assert st.read("step-000000000001/rank-00000.bin", 10, 20) == payload[10:20]
    assert st.size("step-000000000001/rank-00000.bin") == len(payload)
    assert st.exists("step-000000000001/rank-00000.bin")
    assert st.list_names() == ["step-000000000001"]
    assert st.list_names("step-000000000001") == ["rank-00000.bin"]


def test_write_accepts_memoryview_and_overwrites_whole(backend_root: Root) -> None:
    st = _storage(backend_root)
    st.write("a/obj", memoryview(b"first version"))
    st.write("a/obj", memoryview(bytearray(b"second")))
    assert st.read("a/obj") == b"second"
    # No temp names are left next to the object.
    assert st.list_names("a") == ["obj"]


def test_exclusive_create_refuses_second_writer(backend_root: Root) -> None:
    st = _storage(backend_root)
    st.write("step-000000000002/manifest.json", b'{"first": 1}', exclusive=True)
    with pytest.raises(ObjectExistsError) as info:
        st.write("step-000000000002/manifest.json", b'{"second": 2}', exclusive=True)
    assert isinstance(info.value, FileExistsError)
    assert st.read("step-000000000002/manifest.json") == b'{"first": 1}'


def _race(st: Storage, name: str, expected: str | None, num_writers: int = 4) -> list[int]:
    """`num_writers` threads `write_if` the same expected version at once; the winners."""
    start = threading.Barrier(num_writers)
    won: list[int] = []

    def writer(i: int) -> None:
        start.wait(timeout=30)
        try:
            # Distinct from what is there: a version identifies content (see `write_if`).
            st.write_if(name, f"{expected} writer {i}".encode(), expected_version=expected)
        except VersionMismatchError:
            return
        won.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(num_writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return won


def test_conditional_writes_let_exactly_one_racer_win(backend_root: Root) -> None:
    st = _storage(backend_root)
    # Create-if-absent: exactly one of the racers creates the object.
    created = _race(st, "lease/doc", None)
    assert len(created) == 1
    data, version = st.read_with_version("lease/doc")
    assert data == f"None writer {created[0]}".encode()
    # Replace-if-unchanged: racers holding the same version, exactly one replaces it.
    replaced = _race(st, "lease/doc", version)
    assert len(replaced) == 1
    data, newer = st.read_with_version("lease/doc")
    assert data == f"{version} writer {replaced[0]}".encode()
    assert newer != version
    # The stale version is refused from then on, and so is creating what exists.
    with pytest.raises(VersionMismatchError):
        st.write_if("lease/doc", b"late", expected_version=version)
    with pytest.raises(VersionMismatchError):
        st.write_if("lease/doc", b"late", expected_version=None)
    assert st.write_if("lease/doc", b"in turn", expected_version=newer)
    assert st.read_with_version("lease/doc")[0] == b"in turn"
    # A version of an object that is gone is refused too.
    st.remove("lease/doc")
    with pytest.raises(VersionMismatchError):
        st.write_if("lease/doc", b"gone", expected_version=newer)
    with pytest.raises(ObjectNotFoundError):
        st.read_with_version("lease/doc")


def test_missing_objects_raise_not_found(backend_root: Root) -> None:
    st = _storage(backend_root)
    with pytest.raises(ObjectNotFoundError) as info:
        st.read("nope/missing.bin")
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, StorageError)
    assert not st.exists("nope/missing.bin")
    assert st.list_names("nope") == []
    assert st.modified_unix_s("nope") is None


def test_remove_and_remove_tree_are_idempotent(backend_root: Root) -> None:
    st = _storage(backend_root)
    st.write("d/x", b"1")
    st.write("d/sub/y", b"2")
    st.write("keep", b"3")
    st.remove("d/x")
    st.remove("d/x")
    assert not st.exists("d/x")
    st.remove_tree("d")
    st.remove_tree("d")
    assert not st.exists("d/sub/y")
    assert st.list_names() == ["keep"]


def test_modified_time_of_object_and_folder(backend_root: Root) -> None:
    st = _storage(backend_root)
    st.write("f/obj", b"x")
    obj = st.modified_unix_s("f/obj")
    folder = st.modified_unix_s("f")
    assert obj is not None
    assert folder is not None
    assert abs(obj - folder) < 5


def test_large_object_uses_parallel_multipart(backend_root: Root) -> None:
    st = _storage(backend_root)
    chunk = 5 << 20
    payload = os.urandom(2 * chunk + 12345)
    st.write("big/obj", payload, chunk_bytes=chunk, concurrency=3)
    assert st.size("big/obj") == len(payload)
    assert st.read("big/obj", chunk - 7, chunk + 7) == payload[chunk - 7 : chunk + 7]


def test_put_file_publishes_whole_and_streams_multipart(
    backend_root: Root, tmp_path: pathlib.Path
) -> None:
    st = _storage(backend_root)
    chunk = 5 << 20
    payload = os.urandom(2 * chunk + 4321)
    src = tmp_path / "payload.bin"
    src.write_bytes(payload)
    st.put_file(str(src), "out/big.bin", chunk_bytes=chunk, concurrency=3)
    assert st.size("out/big.bin") == len(payload)
    assert st.read("out/big.bin", chunk - 5, chunk + 5) == payload[chunk - 5 : chunk + 5]
    again = tmp_path / "again.bin"
    again.write_bytes(b"second")
    with pytest.raises(ObjectExistsError):
        st.put_file(str(again), "out/big.bin", exclusive=True)
    assert st.size("out/big.bin") == len(payload)
    st.put_file(str(again), "out/big.bin")
    assert st.read("out/big.bin") == b"second"
    if st.is_local:  # no temporaries left next to the published file
        assert os.listdir(tmp_path / "ckpt" / "out") == ["big.bin"]


def test_put_file_across_filesystems_copies_then_moves(tmp_path: pathlib.Path) -> None:
    shm = pathlib.Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temporary folder")
    st = Storage(str(tmp_path / "root"))
    src = shm / f"ckpt-put-{os.getpid()}.bin"
    src.write_bytes(b"across")
    st.put_file(str(src), "a/b.bin")
    assert st.read("a/b.bin") == b"across"
    assert not src.exists()
    assert os.listdir(tmp_path / "root" / "a") == ["b.bin"]


@pytest.mark.parametrize(
    "bad", ["", "/abs", "../x", "a/../b", "a//b", "./a", "s3://other/x", "a\\b", "~/x"]
)
def test_names_are_validated(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid name"):
        validate_relative_name(bad)
    if bad:
        with pytest.raises(ValueError, match="invalid name"):
            Storage("memory://validate").path(bad)


def test_backend_errors_are_translated(tmp_path: object) -> None:
    options = {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    st = Storage("s3://bucket/x", options)
    assert st.is_object_store
    st.fs.retries = 1
    with pytest.raises(StorageError, match="failed"):
        st.read("obj")
