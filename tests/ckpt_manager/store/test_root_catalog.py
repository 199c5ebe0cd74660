"""The root catalog: kept current by commits, retention and pins; reconciled and repaired by
`list_steps` (missing, damaged, stale, naming deleted steps); few requests on S3."""

from __future__ import annotations

import errno
import json
import pathlib
import threading
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._store import root_catalog
from ckpt_manager._store.listing import list_steps
from ckpt_manager._store.pins import is_pinned, pin_committed_step, unpin_step
from ckpt_manager._store.root_catalog import (
    CATALOG_NAME,
    read_catalog,
    record_commit,
)
from ckpt_manager._store.steps import delete_step, read_manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.list import collect_rows
from ckpt_manager.ctl.retention import RetentionFlags
from ckpt_manager.errors import StorageError
from tests.support.request_count import count_requests
from tests.support.s3 import S3Target


def _save_steps(uri: str, steps: list[int], **config: Any) -> Storage:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, **config)
    with CheckpointManager(uri, cfg, run_id="cat") as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.full((3,), float(step))}, metrics={"loss": 1.0 / step})
            mgr.wait_until_finished()
        if mgr._deleter is not None:
            assert mgr._deleter.flush(30)
    return Storage(uri, cfg.storage_options)


def _tiny_manifest(step: int, **metrics: Any) -> bytes:
    """A valid top manifest of 4 ranks with nothing in it (no index is read here)."""
    return Manifest(
        step=step,
        world_size=4,
        run_id="seeded",
        created_unix_s=1000.0 + step,
        committed_unix_s=1001.0 + step,
        versions={},
        metrics=metrics or {"loss": 1.0 / step},
        files={index_file_name(r): FileEntry(0, 0) for r in range(4)},
        tree=None,
        tensors={},
        rank_local=(),
    ).to_json()


def _seed(storage: Storage, steps: range) -> None:
    for s in steps:
        storage.write(f"{step_dir(s)}/{MANIFEST_NAME}", _tiny_manifest(s))


def _catalogued(storage: Storage) -> list[int]:
    snapshot = read_catalog(storage)
    assert snapshot.damage is None
    return sorted(snapshot.entries)


def test_each_commit_adds_what_its_manifest_says(tmp_path: pathlib.Path) -> None:
    storage = _save_steps(str(tmp_path), [2, 4])
    entries = read_catalog(storage).entries
    assert sorted(entries) == [2, 4]
    for step, entry in entries.items():
        manifest = read_manifest(storage, step)
        assert entry.committed_unix_s == manifest.committed_unix_s
        assert entry.num_bytes == manifest.num_bytes > 0
        assert entry.num_files == len(manifest.files) == 2  # the shard and its index
        assert entry.world_size == 1
        assert entry.metrics == {"loss": 1.0 / step}
        assert entry.run_id == "cat"
        assert entry.manifest_bytes == storage.size(f"{step_dir(step)}/{MANIFEST_NAME}")
        assert not entry.pinned
    listing = list_steps(storage)
    assert listing.repair is None  # current: nothing read, nothing rewritten
    assert [e.step for e in listing.committed] == [2, 4]


def test_retention_and_pins_update_the_catalog(tmp_path: pathlib.Path) -> None:
    storage = _save_steps(str(tmp_path), [1, 2, 3], retention=KeepLast(n=2))
    assert _catalogued(storage) == [2, 3]  # the manager's retention dropped step 1
    pin_committed_step(storage, 2)
    assert read_catalog(storage).entries[2].pinned
    unpin_step(storage, 2)
    assert not read_catalog(storage).entries[2].pinned
    assert delete_step(storage, 2)
    assert _catalogued(storage) == [3]
    assert list_steps(storage).repair is None


def test_a_pin_that_undoes_a_deletion_puts_the_entry_back(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _save_steps(str(tmp_path), [1, 2])
    seen = iter([False, True])  # no pin before the manifest goes, a pin right after
    monkeypatch.setattr("ckpt_manager._store.steps.is_pinned", lambda _s, _n: next(seen))
    assert not delete_step(storage, 1)
    assert _catalogued(storage) == [1, 2]
    assert read_manifest(storage, 1).step == 1
    assert not is_pinned(storage, 1)


def test_a_missing_or_damaged_catalog_is_rebuilt_from_the_manifests(
    tmp_path: pathlib.Path,
) -> None:
    storage = Storage(str(tmp_path))
    _seed(storage, range(1, 6))
    storage.write(f"{step_dir(9)}/rank-00000.bin", b"in flight")  # uncommitted
    first = list_steps(storage)
    assert first.repair == "no catalog; 5 committed steps missing from the catalog"
    assert first.repair_error is None
    assert [e.step for e in first.committed] == [1, 2, 3, 4, 5]
    assert first.uncommitted == [9]
    assert _catalogued(storage) == [1, 2, 3, 4, 5]
    assert list_steps(storage).repair is None
    storage.write(CATALOG_NAME, b'{"format": "trainingd-catalog", "format_version": 1}')
    damaged = list_steps(storage)
    assert damaged.repair is not None
    assert "invalid root catalog" in damaged.repair
    assert [e.step for e in damaged.committed] == [1, 2, 3, 4, 5]
    assert _catalogued(storage) == [1, 2, 3, 4, 5]


def test_a_step_committed_without_a_catalog_update_is_found_and_added(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _save_steps(str(tmp_path), [1])
    # A coordinator killed between the manifest PUT and the catalog update.
    monkeypatch.setattr("ckpt_manager._store.publish.record_commit", lambda *a, **k: False)
    _save_steps(str(tmp_path), [2, 3])
    assert _catalogued(storage) == [1]
    listing = list_steps(storage)
    assert listing.repair == "2 committed steps missing from the catalog"
    assert [e.step for e in listing.committed] == [1, 2, 3]
    assert listing.committed[2].metrics == {"loss": 1.0 / 3}
    assert _catalogued(storage) == [1, 2, 3]


def test_deleted_steps_are_dropped_and_a_changed_manifest_wins(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    _seed(storage, range(1, 8))
    list_steps(storage)
    storage.remove_tree(step_dir(2))  # deleted behind the catalog's back
    newest = f"{step_dir(7)}/{MANIFEST_NAME}"
    storage.write(newest, _tiny_manifest(7, loss=0.125, note="rewritten"))
    storage.write(f"{step_dir(6)}/{MANIFEST_NAME}", b"{truncated")
    listing = list_steps(storage)
    assert listing.repair == (
        "1 catalogued steps have no folder; 2 manifests differ from the catalog; "
        "1 committed steps missing from the catalog; catalogued steps without a valid manifest"
    )
    assert [e.step for e in listing.committed] == [1, 3, 4, 5, 7]
    assert listing.committed[-1].metrics == {"loss": 0.125, "note": "rewritten"}
    assert "invalid manifest" in listing.corrupt[6]
    assert _catalogued(storage) == [1, 3, 4, 5, 7]
    assert read_catalog(storage).entries[7].metrics["note"] == "rewritten"


def test_a_repair_never_overwrites_a_concurrent_update(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Storage(str(tmp_path))
    _seed(storage, range(1, 4))
    real = root_catalog.read_catalog

    def commit_lands_after_the_read(st: Storage) -> root_catalog.CatalogSnapshot:
        snapshot = real(st)
        st.write(f"{step_dir(4)}/{MANIFEST_NAME}", _tiny_manifest(4))
        record_commit(st, Manifest.from_json(_tiny_manifest(4)), manifest_bytes=10)
        return snapshot

    monkeypatch.setattr("ckpt_manager._store.listing.read_catalog", commit_lands_after_the_read)
    listing = list_steps(storage)
    assert listing.repair_error is not None
    assert "changed while" in listing.repair_error
    assert _catalogued(storage) == [4]  # the commit's entry survived; the repair waits
    monkeypatch.undo()
    assert [e.step for e in list_steps(storage).committed] == [1, 2, 3, 4]
    assert _catalogued(storage) == [1, 2, 3, 4]


def test_concurrent_writers_lose_no_entry(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    errors: list[BaseException] = []

    def commit_many(first: int) -> None:
        try:
            for s in range(first, first + 40, 2):
                manifest = Manifest.from_json(_tiny_manifest(s))
                assert record_commit(Storage(str(tmp_path)), manifest, manifest_bytes=10)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=commit_many, args=(first,)) for first in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert _catalogued(storage) == list(range(1, 41))


@pytest.mark.s3
def test_list_of_50_steps_on_s3_takes_a_constant_number_of_requests(s3: S3Target) -> None:
    storage = Storage(f"{s3.uri}/runs", s3.storage_options)
    storage.backend.fs.pipe(
        {storage.path(f"{step_dir(s)}/{MANIFEST_NAME}"): _tiny_manifest(s) for s in range(1, 51)}
    )
    flags = RetentionFlags()
    with count_requests(storage) as counted:
        rows = collect_rows(storage, include_uncommitted=False, verify=False, flags=flags)
    assert [r.step for r in rows] == list(range(1, 51))
    assert counted.http["GetObject"] >= 50  # no catalog yet: every manifest read, then repaired
    assert counted.http["PutObject"] == 1
    with count_requests(storage) as counted:
        rows = collect_rows(storage, include_uncommitted=False, verify=False, flags=flags)
    assert [r.step for r in rows] == list(range(1, 51))
    assert rows[-1].to_json(0.0)["metrics"] == {"loss": 1.0 / 50}
    # The catalog, one listing of the root, one of _pins/, a size check (HEAD) of the 4
    # newest manifests, and the retention record (one GET, absent here).
    assert counted.requests <= 8, dict(counted.http)
    assert counted.http["PutObject"] == 0
    doc = json.loads(storage.read(CATALOG_NAME))
    assert [e["step"] for e in doc["entries"]] == list(range(1, 51))


def test_a_root_the_reader_cannot_write_still_lists(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Storage(str(tmp_path))
    _seed(storage, range(1, 4))

    def denied(*_: Any, **__: Any) -> str:
        raise StorageError(errno.EACCES, "write _CATALOG.json: access denied")

    monkeypatch.setattr(storage, "write_if", denied)
    listing = list_steps(storage)
    assert [e.step for e in listing.committed] == [1, 2, 3]
    assert listing.repair_error == (
        "could not rewrite the catalog: [Errno 13] write _CATALOG.json: access denied"
    )
    assert not storage.exists(CATALOG_NAME)
