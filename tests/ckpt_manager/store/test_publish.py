"""The one commit path: `publish_manifest` is the only writer of a manifest, and what it does.

The save's coordinator and `ckptctl reshard` reach it through their own tests
(`save/test_commit.py`, `ctl/test_reshard.py`); here it is called directly, and the package's
source is read (`ast`) to check that nothing else writes `manifest.json`.
"""

from __future__ import annotations

import ast
import json
import pathlib

from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._store.publish import CommitResult, publish_manifest
from ckpt_manager._store.root_catalog import read_catalog
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CommitConflictError, LeaseLostError

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "ckpt_manager"
PUBLISHER = "ckpt_manager._store.publish"
_WRITES = {"write", "write_if", "put_file", "pipe", "pipe_file", "open"}


def _manifest(step: int, run_id: str = "r") -> Manifest:
    return Manifest(
        step=step,
        world_size=1,
        run_id=run_id,
        created_unix_s=1.0,
        committed_unix_s=2.0,
        versions={},
        metrics={"loss": 0.5},
        files={index_file_name(0): FileEntry(10, 7)},
        tree=None,
        tensors={},
        rank_local=(),
    )


def manifest_writers(modules: dict[str, ast.Module]) -> set[str]:
    """Modules with a storage write (`write`, `put_file`, ...) whose arguments name
    `MANIFEST_NAME`."""
    found = set()
    for module, tree in modules.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in _WRITES:
                continue
            args = [*node.args, *(k.value for k in node.keywords)]
            if any(
                isinstance(n, ast.Name) and n.id == "MANIFEST_NAME"
                for arg in args
                for n in ast.walk(arg)
            ):
                found.add(module)
    return found


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts)] = ast.parse(path.read_text())
    return out


def test_only_publish_writes_a_manifest() -> None:
    assert manifest_writers(_modules()) == {PUBLISHER}


def test_a_second_manifest_writer_is_reported() -> None:
    modules = _modules()
    modules["ckpt_manager.ctl.reshard"] = ast.parse(
        "def f(dest, m):\n"
        "    dest.write(f'{step_dir(m.step)}/{MANIFEST_NAME}', m.to_json(), exclusive=True)\n"
    )
    assert manifest_writers(modules) == {PUBLISHER, "ckpt_manager.ctl.reshard"}


def test_a_publish_writes_the_manifest_and_records_it_in_the_catalog(
    tmp_path: pathlib.Path,
) -> None:
    storage = Storage(str(tmp_path))
    manifest = _manifest(4)
    outcome = publish_manifest(storage, manifest, fence=lambda: None)
    assert outcome.result is CommitResult.COMMITTED
    assert outcome.committed_unix_s == manifest.committed_unix_s
    assert storage.read(f"{step_dir(4)}/{MANIFEST_NAME}") == manifest.to_json()
    assert read_catalog(storage).entries[4].world_size == 1


def test_a_fenced_publish_writes_nothing(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))

    def lost() -> None:
        raise LeaseLostError("the lease was taken over by run 'other'")

    outcome = publish_manifest(storage, _manifest(4), fence=lost)
    assert outcome.result is CommitResult.FENCED
    assert isinstance(outcome.conflict, LeaseLostError)
    assert "run 'other'" in outcome.cause
    assert not storage.exists(f"{step_dir(4)}/{MANIFEST_NAME}")
    assert read_catalog(storage).entries == {}


def test_an_existing_manifest_is_ours_or_a_conflict(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    ours = _manifest(4)
    # The same bytes already there (a retried write whose first reply was lost): committed.
    storage.write(f"{step_dir(4)}/{MANIFEST_NAME}", ours.to_json())
    assert publish_manifest(storage, ours).result is CommitResult.COMMITTED
    # Another attempt's manifest: a conflict naming its run, and the manifest kept.
    theirs = _manifest(5, run_id="other-launch")
    storage.write(f"{step_dir(5)}/{MANIFEST_NAME}", theirs.to_json())
    outcome = publish_manifest(storage, _manifest(5))
    assert outcome.result is CommitResult.CONFLICT
    assert isinstance(outcome.conflict, CommitConflictError)
    assert outcome.conflict.other_run_id == "other-launch"
    kept = json.loads(storage.read(f"{step_dir(5)}/{MANIFEST_NAME}"))
    assert kept["run_id"] == "other-launch"
