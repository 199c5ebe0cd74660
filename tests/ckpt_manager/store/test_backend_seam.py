"""The storage backend seam, read from the source with `ast`: only `_store/backends/` knows
which store a root is on.

Outside `ckpt_manager/_store/backends/`, no module of `ckpt_manager` may compare anything
against a protocol name (`"s3"`, `"file"`, `"memory"`, ...: directly, inside a literal tuple or
set, in a `match` case or a `startswith("s3://")`), hold a literal collection of protocol
names, read `.protocol` / `.is_local` / `.is_object_store`, import a filesystem
implementation (`s3fs`, fsspec's `LocalFileSystem`) or a backend module itself (only the
registry, `ckpt_manager._store.backends`, is importable from outside). Callers ask
`Storage.capabilities` instead; adding a backend is then one file in `backends/` plus its
registration line.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.support.imports import parse_package

REPO = pathlib.Path(__file__).resolve().parents[3]
PACKAGE = REPO / "ckpt_manager"
BACKENDS_PACKAGE = "ckpt_manager._store.backends"

# Protocol names of fsspec filesystems a checkpoint root could be on (fsspec's registry has
# more, e.g. "data", "dir", "reference", too common as plain words to ban everywhere).
PROTOCOL_NAMES = frozenset(
    {
        "s3",
        "s3a",
        "gs",
        "gcs",
        "az",
        "abfs",
        "abfss",
        "adl",
        "oss",
        "file",
        "local",
        "memory",
        "hdfs",
        "webhdfs",
        "sftp",
        "ftp",
        "simplecache",
        "filecache",
        "blockcache",
    }
)
PROTOCOL_ATTRIBUTES = frozenset({"protocol", "is_local", "is_object_store"})
FILESYSTEM_MODULES = ("s3fs", "gcsfs", "adlfs", "fsspec.implementations")
FILESYSTEM_CLASSES = frozenset({"LocalFileSystem", "S3FileSystem", "MemoryFileSystem"})
_PREFIX_METHODS = frozenset({"startswith", "endswith", "removeprefix", "removesuffix"})


def _protocol_literal(node: ast.AST) -> str | None:
    """The protocol name a string constant stands for (`"s3"`, `"s3://"`), else None."""
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
        return None
    name = node.value.split("://", 1)[0] if "://" in node.value else node.value
    return name if name in PROTOCOL_NAMES else None


def _protocols_in(node: ast.AST) -> list[str]:
    """Protocol names in `node` itself or among the elements of a literal collection."""
    found = _protocol_literal(node)
    if found is not None:
        return [found]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [p for e in node.elts if (p := _protocol_literal(e)) is not None]
    return []


def _violations_in(module: str, tree: ast.Module) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        where = f"{module}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                for name in _protocols_in(operand):
                    problems.append(f"{where}: compares against protocol {name!r}")
        elif isinstance(node, ast.MatchValue):
            for name in _protocols_in(node.value):
                problems.append(f"{where}: matches protocol {name!r}")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and node.elts:
            names = _protocols_in(node)
            if len(names) == len(node.elts):
                problems.append(f"{where}: holds protocol names {names}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _PREFIX_METHODS:
                for arg in node.args:
                    for name in _protocols_in(arg):
                        problems.append(f"{where}: {func.attr} on protocol {name!r}")
        elif isinstance(node, ast.Attribute) and node.attr in PROTOCOL_ATTRIBUTES:
            problems.append(f"{where}: reads .{node.attr}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            targets = names if isinstance(node, ast.Import) else [node.module or "", *names]
            for target in targets:
                if target.startswith(FILESYSTEM_MODULES) or target in FILESYSTEM_CLASSES:
                    problems.append(f"{where}: imports {target}")
                elif target.startswith(BACKENDS_PACKAGE + "."):
                    problems.append(f"{where}: imports {target} (use the registry)")
    return problems


def seam_violations(modules: dict[str, ast.Module]) -> list[str]:
    """Each place outside `_store/backends/` that asks which store a root is on."""
    problems = []
    for module, tree in sorted(modules.items()):
        if module == BACKENDS_PACKAGE or module.startswith(BACKENDS_PACKAGE + "."):
            continue
        problems += _violations_in(module, tree)
    return problems


def test_only_the_backends_know_the_protocol() -> None:
    assert seam_violations(parse_package(PACKAGE)) == []


def test_the_backends_package_exists() -> None:
    # The exemption above must name a real package, or the test would pass vacuously.
    assert BACKENDS_PACKAGE in parse_package(PACKAGE)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "ckpt_manager._save.writer",
            "if storage.protocol in ('s3', 's3a'):\n    pass\n",
            "ckpt_manager._save.writer:1: compares against protocol 's3'",
        ),
        (
            "ckpt_manager._save.writer",
            "if storage.protocol in ('s3', 's3a'):\n    pass\n",
            "ckpt_manager._save.writer:1: reads .protocol",
        ),
        (
            "ckpt_manager.ctl.sink",
            "local = self.storage.is_local\n",
            "ckpt_manager.ctl.sink:1: reads .is_local",
        ),
        (
            "ckpt_manager.ctl.common",
            "def f(storage):\n    return 3 if storage.is_object_store else 0\n",
            "ckpt_manager.ctl.common:2: reads .is_object_store",
        ),
        (
            "ckpt_manager._store.options",
            "SCHEMES = ('s3', 's3a')\n",
            "ckpt_manager._store.options:1: holds protocol names ['s3', 's3a']",
        ),
        (
            "ckpt_manager._store.options",
            "def f(uri):\n    return uri_scheme(uri) == 'memory'\n",
            "ckpt_manager._store.options:2: compares against protocol 'memory'",
        ),
        (
            "ckpt_manager.ctl.restore",
            "ok = uri.startswith('s3://')\n",
            "ckpt_manager.ctl.restore:1: startswith on protocol 's3'",
        ),
        (
            "ckpt_manager.ctl.restore",
            "match scheme:\n    case 'gs':\n        pass\n",
            "ckpt_manager.ctl.restore:2: matches protocol 'gs'",
        ),
        (
            "ckpt_manager._store.storage",
            "from fsspec.implementations.local import LocalFileSystem\n",
            "ckpt_manager._store.storage:1: imports fsspec.implementations.local",
        ),
        (
            "ckpt_manager._store.storage",
            "def f():\n    import s3fs\n",
            "ckpt_manager._store.storage:2: imports s3fs",
        ),
        (
            "ckpt_manager._store.lease",
            "from ckpt_manager._store.backends.s3 import S3Backend\n",
            "ckpt_manager._store.lease:1: imports ckpt_manager._store.backends.s3 "
            "(use the registry)",
        ),
    ],
)
def test_a_protocol_branch_outside_the_backends_is_reported(
    module: str, source: str, expected: str
) -> None:
    modules = parse_package(PACKAGE)
    modules[module] = ast.parse(source)
    assert expected in seam_violations(modules)


def test_the_backends_may_branch_on_the_protocol() -> None:
    modules = parse_package(PACKAGE)
    modules[f"{BACKENDS_PACKAGE}.s3"] = ast.parse("import s3fs\nSCHEMES = ('s3', 's3a')\n")
    assert seam_violations(modules) == seam_violations(parse_package(PACKAGE))


def test_the_daemon_does_not_ask_which_store_a_root_is_on_either() -> None:
    # The daemon checks, lists and opens roots through ckpt_manager's public API only
    # (`check_root_writable`, `S3Options.serves`, `committed_checkpoints`, ...).
    assert seam_violations(parse_package(REPO / "daemon")) == []
