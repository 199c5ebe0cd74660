"""A package's modules and their imports, read from the source with `ast` (nothing is imported).

The layering tests (`tests/ckpt_manager/test_layering.py`, `tests/daemon/test_layering.py`) and
the storage seam test (`tests/ckpt_manager/store/test_backend_seam.py`) check rules about what
the code imports without running it: a module imported for the test would already have run its
imports, and a rule about an import in a function body or under `TYPE_CHECKING` could not be
seen at all.

A module is named by its dotted name (`ckpt_manager._store.pins`); a package's `__init__.py` by
the package's name (`ckpt_manager._store`). The names an import statement imports are absolute:
relative imports are resolved the way the interpreter resolves them, against the package of a
plain module and against the package itself for an `__init__.py`.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """The dotted name of the module at `path`.

    Args:
        path: A `.py` file below `root`.
        root: The folder that holds the top-level package (`sys.path`'s entry for it).

    Returns:
        `a.b.c` for `<root>/a/b/c.py`, `a.b` for `<root>/a/b/__init__.py`.
    """
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def parse_package(directory: pathlib.Path) -> dict[str, ast.Module]:
    """Every module of the package at `directory` (sub-packages included), parsed.

    Args:
        directory: The package's folder, e.g. the repository's `daemon/`.

    Returns:
        `{dotted name: module's tree}`, in the order of the files' sorted paths; names start
        with the package's own (`daemon`, `daemon.agent`, `daemon.agent.run`, ...).
    """
    return {
        module_name(path, directory.parent): ast.parse(path.read_text())
        for path in sorted(directory.rglob("*.py"))
    }


def is_package(module: str, root: pathlib.Path) -> bool:
    """Whether `module` is a package, i.e. its source is an `__init__.py` below `root`.

    Args:
        module: A dotted module name.
        root: The folder that holds the top-level package, as for `module_name`.

    Returns:
        True for a package; False for a plain module, or a name with no source under `root`
        (a module a test made up).
    """
    return root.joinpath(*module.split("."), "__init__.py").is_file()


def imported_names(node: ast.AST, module: str, *, is_package: bool) -> Iterator[str]:
    """The absolute names that `node` imports, if it is an import statement.

    `import a.b` yields `a.b`. `from a.b import c` yields `a.b` and `a.b.c`: `c` may be a
    submodule (`from ckpt_manager._store import storage`), and which it is cannot be told from
    the statement alone, so callers keep the names they know to be modules.

    Args:
        node: Any node; only `ast.Import` and `ast.ImportFrom` yield names.
        module: The dotted name of the module the statement is in.
        is_package: Whether that module is a package's `__init__.py`; a relative import
            there starts from the package itself, elsewhere from the module's package.

    Yields:
        Each imported name, relative imports resolved.

    Raises:
        ValueError: A relative import climbs above the top-level package.
    """
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        target = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            if node.level > len(package):
                raise ValueError(
                    f"{module}: relative import of level {node.level} "
                    f"({'.' * node.level}{target}) climbs above the top-level package"
                )
            base = package[: len(package) - node.level + 1]
            target = ".".join([*base, target] if target else base)
        yield target
        for alias in node.names:
            yield f"{target}.{alias.name}"


def all_imports(tree: ast.Module, module: str, *, is_package: bool) -> set[str]:
    """Every name `tree` imports, wherever the import is written.

    Module level, inside functions and classes, under `if TYPE_CHECKING:`: each counts.

    Args:
        tree: The module's tree.
        module: Its dotted name.
        is_package: Whether it is a package's `__init__.py` (see `imported_names`).

    Returns:
        The names, as `imported_names` gives them.
    """
    return {
        name
        for node in ast.walk(tree)
        for name in imported_names(node, module, is_package=is_package)
    }


def module_level_imports(tree: ast.Module, module: str, *, is_package: bool) -> set[str]:
    """The names `tree` imports when the module itself is imported.

    The statements at module level, including those in the branches of `if` / `try` blocks
    there, but not those under an `if` whose test names `TYPE_CHECKING` (only its `else` runs)
    nor those in function bodies (they run when called, on the path that needs them). Other
    blocks (`class`, `with`, `match`, loops) are not looked into.

    Args:
        tree: The module's tree.
        module: Its dotted name, against which relative imports resolve.
        is_package: True for a package's `__init__.py`.

    Returns:
        The subset of `all_imports(tree, module, is_package=is_package)` that runs on import.
    """
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                    visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)
                visit(stmt.orelse)
                visit(stmt.finalbody)
            elif isinstance(stmt, ast.Import | ast.ImportFrom):
                found.update(imported_names(stmt, module, is_package=is_package))

    visit(tree.body)
    return found
