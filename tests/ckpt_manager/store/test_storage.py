"""Storage contract: one suite over every registered backend (`_store/backends/`): local
disk, `memory://` (the generic fsspec backend), moto S3 and SeaweedFS (the S3 backend).

The tests that start with `test_capability_` check each `Capabilities` field against what
the store does, so a backend that claims a capability it lacks fails here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from ckpt_manager._format.names import validate_relative_name
from ckpt_manager._store import storage as storage_module
from ckpt_manager._store.backends import registered_backends
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    VersionMismatchError,
)
from tests.ckpt_manager.conftest import BACKEND_OF_FIXTURE, Root

pytestmark = pytest.mark.s3

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


def _storage(root: Root) -> Storage:
    return Storage(root.uri, root.storage_options)


def test_every_registered_backend_runs_the_contract_suite() -> None:
    # A backend added to the registry without a `backend_root` fixture fails here.
    registered = {b.name for b in registered_backends()}
    assert registered == set(BACKEND_OF_FIXTURE.values())


def test_a_registered_filesystem_under_another_scheme_keeps_its_backend(
    tmp_path: pathlib.Path,
) -> None:
    # `slowfile://` is fsspec's LocalFileSystem under a protocol of its own: local disk, so
    # the local backend (rename, flock, parent folders made), not the generic one.
    from ckpt_manager._store.backends.local import LocalBackend
    from tests.support import slow_fs

    slow_fs.register()
    st = Storage(f"{slow_fs.PROTOCOL}://{tmp_path / 'slow'}")
    assert isinstance(st.backend, LocalBackend)
    assert st.capabilities.local_paths
    st.write_if("new/folder/doc", b"made", expected_version=None)
    assert st.read("new/folder/doc") == b"made"
    assert not Storage(f"memory://{tmp_path}").capabilities.local_paths


def test_the_root_is_served_by_its_registered_backend(backend_root: Root) -> None:
    backend = _storage(backend_root).backend
    assert getattr(type(backend), "name", None) == BACKEND_OF_FIXTURE[backend_root.fixture]


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


def test_read_into_fills_the_buffer_and_counts_a_short_end(backend_root: Root) -> None:
    st = _storage(backend_root)
    payload = bytes(range(256)) * 40
    st.write("step-000000000001/rank-00000.bin", payload)
    buffer = bytearray(b"\xee" * 64)
    view = memoryview(buffer)
    assert st.read_into("step-000000000001/rank-00000.bin", 100, view[8:40]) == 32
    assert buffer[8:40] == payload[100:132]
    assert buffer[:8] == b"\xee" * 8  # nothing outside the slice given
    assert buffer[40:] == b"\xee" * 24
    # Past the end: the count says how much there was.
    assert st.read_into("step-000000000001/rank-00000.bin", len(payload) - 10, view) == 10
    assert buffer[:10] == payload[-10:]
    assert st.read_into("step-000000000001/rank-00000.bin", 0, view[:0]) == 0
    with pytest.raises(ObjectNotFoundError):
        st.read_into("step-000000000001/absent.bin", 0, view)


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


_CHECK_THEN_WRITE = {
    "moto": "moto's server checks If-Match / If-None-Match, then writes, with no lock between "
    "(moto 5.2 `s3/responses.py` `put_object`): two racers can both win under load (seen in "
    "CI); AWS S3 and SeaweedFS decide a conditional write atomically"
}
"""Test servers whose conditional PUT is not atomic: the sequential semantics are checked on
them, the race is not (it would test the server, and flake)."""


def test_conditional_writes_let_exactly_one_racer_win(backend_root: Root) -> None:
    st = _storage(backend_root)
    racing = backend_root.fixture not in _CHECK_THEN_WRITE
    # Create-if-absent: exactly one of the racers creates the object.
    if racing:
        created = _race(st, "lease/doc", None)
        assert len(created) == 1
    else:
        created = [0]
        assert st.write_if("lease/doc", b"None writer 0", expected_version=None)
    data, version = st.read_with_version("lease/doc")
    assert data == f"None writer {created[0]}".encode()
    # Replace-if-unchanged: racers holding the same version, exactly one replaces it.
    if racing:
        replaced = _race(st, "lease/doc", version)
        assert len(replaced) == 1
    else:
        replaced = [0]
        assert st.write_if("lease/doc", f"{version} writer 0".encode(), expected_version=version)
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
    if st.capabilities.local_paths:  # no temporaries left next to the published file
        assert os.listdir(os.path.dirname(st.path("out/big.bin"))) == ["big.bin"]


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
    assert st.capabilities.remote
    st.backend.fs.retries = 1
    with pytest.raises(StorageError, match="failed"):
        st.read("obj")


def test_same_root_as_compares_the_store_and_the_path(backend_root: Root) -> None:
    st = _storage(backend_root)
    assert st.same_root_as(Storage(backend_root.uri, backend_root.storage_options))
    assert not st.same_root_as(Storage(f"{backend_root.uri}/other", backend_root.storage_options))
    # The same path on another store is another root.
    elsewhere = "memory://" if st.capabilities.local_paths else "file://"
    assert not st.same_root_as(Storage(f"{elsewhere}{st.root}"))


def test_describe_missing_root_names_what_is_missing(backend_root: Root) -> None:
    st = Storage(f"{backend_root.uri}/never-written", backend_root.storage_options)
    assert not st.exists("")
    reason = st.describe_missing_root()
    if st.capabilities.remote:  # the bucket is there, the prefix is not
        assert reason == "no such prefix in the bucket (no checkpoint was written there)"
    else:
        assert reason == "no such file or directory"


def test_capability_local_paths_are_real_files(backend_root: Root) -> None:
    st = _storage(backend_root)
    st.write("cap/obj.bin", b"on this host?")
    if st.capabilities.local_paths:
        with open(st.path("cap/obj.bin"), "rb") as f:
            assert f.read() == b"on this host?"
    else:
        assert not os.path.exists(st.path("cap/obj.bin"))


def test_capability_progressive_write_sends_parts_as_they_become_final(
    backend_root: Root,
) -> None:
    st = _storage(backend_root)
    payload = bytearray(os.urandom(3 << 20))
    half = len(payload) // 2
    name = "cap/staged.bin"
    seen: list[tuple[bool, int]] = []  # (published, bytes in a temporary), after each count

    def observe() -> tuple[bool, int]:
        temporaries = 0
        if st.capabilities.local_paths:
            folder = os.path.dirname(st.path(name))
            for entry in os.listdir(folder) if os.path.isdir(folder) else []:
                if entry.startswith("staged.bin.tmp-"):
                    temporaries += os.path.getsize(os.path.join(folder, entry))
        return st.exists(name), temporaries

    def counts() -> Iterator[int]:
        yield half
        seen.append(observe())  # the consumer took the first count and asks for the next
        yield len(payload)
        seen.append(observe())

    st.write(name, memoryview(payload), staged=counts())
    assert st.read(name) == bytes(payload)
    assert [published for published, _ in seen] == [False, False]
    if st.capabilities.progressive_write:
        assert st.capabilities.local_paths, "observe a progressive write on this store too"
        assert seen[0][1] >= half, seen
        assert seen[1][1] == len(payload), seen
    else:  # nothing was written before the last count
        assert [temporaries for _, temporaries in seen] == [0, 0]


def test_capability_remote_stores_wait_out_transient_failures(
    backend_root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = _storage(backend_root)
    slept: list[float] = []
    monkeypatch.setattr(storage_module.time, "sleep", slept.append)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("connection reset by peer")
        return "done"

    retried: list[str] = []
    deadline = time.monotonic() + 60
    if st.capabilities.remote:
        assert st.retrying(flaky, deadline=deadline, on_retry=lambda e, d: retried.append(str(e)))
        assert retried == ["connection reset by peer"]
        assert slept == [1.0]
    else:
        with pytest.raises(ConnectionError):
            st.retrying(flaky, deadline=deadline)
        assert len(calls) == 1
    # A refusal is never retried, on any store.
    calls.clear()

    def refused() -> None:
        calls.append(1)
        raise PermissionError("access denied")

    with pytest.raises(PermissionError):
        st.retrying(refused, deadline=deadline)
    assert len(calls) == 1


def test_capability_read_hints_fit_the_store(backend_root: Root) -> None:
    caps = _storage(backend_root).capabilities
    # Remote reads are latency-bound: prefetched and concurrent; local ones are not.
    assert (caps.read_prefetch > 0) == caps.remote
    assert (caps.read_concurrency > 1) == caps.remote


_RACER = textwrap.dedent(
    """
    import json, sys
    from ckpt_manager._store.storage import Storage
    from ckpt_manager.errors import ObjectExistsError, VersionMismatchError

    uri, options, who = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    st = Storage(uri, options)
    st.exists("warm-up")  # client and event loop set up before the start
    print("ready", flush=True)
    sys.stdin.readline()  # the start: every racer is ready
    won = {}
    try:
        st.write_if("race/doc", f"doc {who}".encode(), expected_version=None)
        won["doc"] = True
    except VersionMismatchError:
        won["doc"] = False
    try:
        st.write("race/marker", f"marker {who}".encode(), exclusive=True)
        won["marker"] = True
    except ObjectExistsError:
        won["marker"] = False
    print(json.dumps(won))
    """
)


def test_capability_other_processes_share_the_root_and_race_fairly(backend_root: Root) -> None:
    st = _storage(backend_root)
    caps = st.capabilities
    num = 2
    racers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RACER,
                backend_root.uri,
                json.dumps(backend_root.storage_options),
                str(i),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        for i in range(num)
    ]
    for racer in racers:
        assert racer.stdout is not None
        assert racer.stdout.readline().strip() == "ready"
    for racer in racers:
        assert racer.stdin is not None
        racer.stdin.write("go\n")
        racer.stdin.flush()
    results = []
    for racer in racers:
        out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    doc_winners = [i for i, r in enumerate(results) if r["doc"]]
    marker_winners = [i for i, r in enumerate(results) if r["marker"]]
    if not caps.shared_across_processes:
        # Each process has a store of its own: every racer wins, none is seen here.
        assert len(doc_winners) == len(marker_winners) == num
        assert not st.exists("race/doc")
        assert not st.exists("race/marker")
        return
    # Race-free: exactly one racer wins each; otherwise a late one may overwrite an early one.
    assert len(doc_winners) == 1 if caps.race_free_conditional_write else doc_winners, results
    assert len(marker_winners) == 1 if caps.race_free_exclusive_create else marker_winners
    assert st.read("race/doc") in {f"doc {i}".encode() for i in doc_winners}
    assert st.read("race/marker") in {f"marker {i}".encode() for i in marker_winners}
