"""`tests.support.imports`: names, relative imports and which imports run at import time."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

from tests.support.imports import (
    all_imports,
    imported_names,
    is_package,
    module_level_imports,
    parse_package,
)


def _names(statement: str, module: str, *, package: bool) -> list[str]:
    (node,) = ast.parse(statement).body
    return list(imported_names(node, module, is_package=package))


@pytest.mark.parametrize(
    ("module", "package", "statement"),
    [
        ("pkg.sub.mod", False, "from . import x"),
        ("pkg.sub.mod", False, "from .other import x"),
        ("pkg.sub.mod", False, "from .. import x"),
        ("pkg.sub.mod", False, "from ..util.deep import x"),
        ("pkg.sub", True, "from . import x"),
        ("pkg.sub", True, "from .other import x"),
        ("pkg.sub", True, "from .. import x"),
        ("pkg.sub", True, "from ..util import x"),
        ("pkg", True, "from .sub import x"),
    ],
)
def test_relative_imports_resolve_as_the_interpreter_does(
    module: str, package: bool, statement: str
) -> None:
    # The interpreter resolves against `__package__`: the package itself for an __init__.py.
    anchor = module if package else module.rpartition(".")[0]
    expected = importlib.util.resolve_name(statement.split()[1], anchor)
    assert _names(statement, module, package=package) == [expected, f"{expected}.x"]


@pytest.mark.parametrize(
    ("module", "package", "statement"),
    [("pkg.mod", False, "from .. import x"), ("pkg", True, "from ..other import x")],
)
def test_a_relative_import_above_the_top_package_is_an_error(
    module: str, package: bool, statement: str
) -> None:
    anchor = module if package else module.rpartition(".")[0]
    with pytest.raises(ImportError, match="beyond top-level package"):
        importlib.util.resolve_name(statement.split()[1], anchor)
    with pytest.raises(ValueError, match="climbs above the top-level package"):
        _names(statement, module, package=package)


def test_absolute_imports_name_the_module_and_each_imported_name() -> None:
    assert _names("import a.b, c", "pkg.mod", package=False) == ["a.b", "c"]
    assert _names("from a.b import c, d", "pkg.mod", package=False) == ["a.b", "a.b.c", "a.b.d"]
    assert _names("x = 1", "pkg.mod", package=False) == []


def test_module_level_imports_leave_out_functions_and_type_checking() -> None:
    source = (
        "import a\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "try:\n    import d\nexcept ImportError:\n    import e\nfinally:\n    import f\n"
        "def g():\n    import h\n"
    )
    tree = ast.parse(source)
    top = module_level_imports(tree, "pkg.mod", is_package=False)
    assert top == {"a", "typing", "typing.TYPE_CHECKING", "c", "d", "e", "f"}
    assert all_imports(tree, "pkg.mod", is_package=False) == top | {"b", "h"}


def test_parse_package_names_modules_and_packages(tmp_path: pathlib.Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for path in ["pkg/__init__.py", "pkg/mod.py", "pkg/sub/__init__.py", "pkg/sub/leaf.py"]:
        (tmp_path / path).write_text("import os\n")
    modules = parse_package(tmp_path / "pkg")
    assert list(modules) == ["pkg", "pkg.mod", "pkg.sub", "pkg.sub.leaf"]
    assert all(ast.dump(tree) == ast.dump(ast.parse("import os\n")) for tree in modules.values())
    packages = {name for name in modules if is_package(name, tmp_path)}
    assert packages == {"pkg", "pkg.sub"}
    assert not is_package("pkg.made_up", tmp_path)
