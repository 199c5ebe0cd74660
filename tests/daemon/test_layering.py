"""The layering of `daemon` by process, read from the source with `ast`.

Every import counts (module level, inside functions, under TYPE_CHECKING): a function-level
import of the other side still ties the two processes together. The rules are those of the
module plan in `daemon/__init__.py`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.support.imports import all_imports, is_package, parse_package

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "daemon"

# Modules both processes use. They import only each other.
SHARED = {
    "config",
    "_config_load",
    "_logging",
    "errors",
    "_version",
    "metrics",
    "_device",
    "_lifecycle",
    "_storage",
}
# Which parts each part may import. A part is a sub-package (`agent`, `rank`, ...) or a root
# module (`cli`, `worker`, `config`, ...).
ALLOWED: dict[str, set[str]] = {
    **{module: SHARED for module in SHARED},
    "rundir": SHARED,
    "jobs": SHARED,
    "data": SHARED,
    "rank": SHARED | {"rundir", "jobs", "data"},
    "worker": SHARED | {"rundir", "jobs", "rank", "data"},
    "observe": SHARED | {"rundir"},
    "agent": SHARED | {"rundir", "jobs", "observe"},
    # The daemon process's entry hands the agent the rank entry point (`run_daemon(cfg, entry)`).
    # `trainingd status` reads a daemon's status or run directory (`observe/report.py`).
    "cli": SHARED | {"agent", "worker", "data", "observe"},
    "default_job": {"jobs"},
    "__init__": SHARED | {"jobs"},
}
SUBPACKAGES = {"agent", "observe", "rank", "jobs", "rundir", "data"}
# The two processes, checked apart from ALLOWED so that loosening a rule there cannot let one
# side reach into the other.
RANK_SIDE = {"rank", "worker"}
AGENT_SIDE = {"agent", "observe", "cli"}


def _part(module: str) -> str:
    """The layering unit of a module inside daemon (`daemon` itself: `__init__`)."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _modules() -> dict[str, ast.Module]:
    return parse_package(PACKAGE)


def _imports(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each module's imports of other daemon modules (every import statement counts)."""
    found = {}
    for module, tree in modules.items():
        names = all_imports(tree, module, is_package=is_package(module, REPO))
        found[module] = {n for n in names if n in modules and n != module}
    return found


def layering_violations(modules: dict[str, ast.Module]) -> list[str]:
    """Each import that crosses the allowed edges, as `importer -> imported (rule)`."""
    problems = []
    for module, names in _imports(modules).items():
        part = _part(module)
        allowed = ALLOWED.get(part)
        if allowed is None:
            problems.append(f"{module}: part {part!r} has no layering rule; add it to ALLOWED")
            continue
        for name in sorted(names):
            other = _part(name)
            # A package's own `__init__` (its docstring) is no dependency of its modules.
            if other != part and other not in allowed and name != "daemon":
                problems.append(f"{module} -> {name} ({part} may not import {other})")
    return problems


def side_violations(modules: dict[str, ast.Module]) -> list[str]:
    """Imports between the rank process's modules and the daemon process's modules."""
    problems = []
    for module, names in _imports(modules).items():
        part = _part(module)
        for name in sorted(names):
            other = _part(name)
            if part in RANK_SIDE and other in AGENT_SIDE:
                problems.append(f"{module} -> {name} (the rank side imports the daemon side)")
            # cli hands the agent the rank entry point: the one edge from the daemon process's
            # code to the rank's, and it is to the entry point, not into `rank/`.
            if part in AGENT_SIDE and other in RANK_SIDE and (part, other) != ("cli", "worker"):
                problems.append(f"{module} -> {name} (the daemon side imports the rank side)")
    return problems


def test_every_part_has_a_rule_and_the_subpackages_exist() -> None:
    parts = {_part(m) for m in _modules()}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)
    assert parts >= SUBPACKAGES


def test_imports_follow_the_layering() -> None:
    assert layering_violations(_modules()) == []


def test_the_rank_side_and_the_daemon_side_never_import_each_other() -> None:
    assert side_violations(_modules()) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "daemon.rank.loop",
            "from daemon.agent.preflight import check_startup\n",
            "daemon.rank.loop -> daemon.agent.preflight (rank may not import agent)",
        ),
        (
            "daemon.rank.telemetry",
            "def f():\n    from daemon.observe.collector import RankView\n",
            "daemon.rank.telemetry -> daemon.observe.collector (rank may not import observe)",
        ),
        (
            "daemon.agent.supervisor",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from daemon.rank.telemetry import RankTelemetry\n",
            "daemon.agent.supervisor -> daemon.rank.telemetry (agent may not import rank)",
        ),
        (
            "daemon.agent.run",
            "def entry():\n    from daemon.worker import elastic_entry\n",
            "daemon.agent.run -> daemon.worker (agent may not import worker)",
        ),
        (
            "daemon.observe.collector",
            "from daemon.agent import supervisor\n",
            "daemon.observe.collector -> daemon.agent.supervisor (observe may not import agent)",
        ),
        (
            "daemon.rundir.snapshot",
            "from daemon.rank.telemetry import RankTelemetry\n",
            "daemon.rundir.snapshot -> daemon.rank.telemetry (rundir may not import rank)",
        ),
        (
            "daemon.config",
            "from daemon.jobs.job import JobSpec\n",
            "daemon.config -> daemon.jobs.job (config may not import jobs)",
        ),
    ],
)
def test_a_forbidden_import_is_reported(module: str, source: str, expected: str) -> None:
    modules = _modules()
    modules[module] = ast.parse(source)
    assert expected in layering_violations(modules)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "daemon.worker",
            "from daemon.observe.state import NodePhase\n",
            "daemon.worker -> daemon.observe.state (the rank side imports the daemon side)",
        ),
        (
            "daemon.agent.elastic",
            "def f():\n    import daemon.rank.loop\n",
            "daemon.agent.elastic -> daemon.rank.loop (the daemon side imports the rank side)",
        ),
        (
            "daemon.cli",
            "from daemon.rank.loop import run_training\n",
            "daemon.cli -> daemon.rank.loop (the daemon side imports the rank side)",
        ),
    ],
)
def test_an_import_across_the_processes_is_reported_even_if_allowed(
    module: str, source: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even with every part allowed everything, the process check still reports it.
    monkeypatch.setattr(
        "tests.daemon.test_layering.ALLOWED", {part: set(ALLOWED) for part in ALLOWED}
    )
    modules = _modules()
    modules[module] = ast.parse(source)
    assert layering_violations(modules) == []
    assert expected in side_violations(modules)


def _planned(doc: str) -> set[str]:
    """`<folder>/.../<module>.py` for every module the `daemon/` tree in `doc` lists (folders
    end in `/`; each level is indented 2 more than its folder; a package's `__init__.py` is
    not listed)."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "daemon/")
    top = len(lines[start]) - len(lines[start].lstrip()) + 2
    names: set[str] = set()
    folders: list[str] = []  # the folder of each level below `daemon/`
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        indent = len(line) - len(line.lstrip())
        if indent < top or (indent - top) % 2 or (indent - top) // 2 > len(folders):
            continue  # a wrapped description line
        depth = (indent - top) // 2
        del folders[depth:]
        name = line.split()[0]
        if name.endswith("/"):
            folders.append(name)
        else:
            names.add("".join(folders) + name)
    return names


def test_the_module_plan_lists_every_module() -> None:
    import daemon

    assert daemon.__doc__ is not None
    planned = _planned(daemon.__doc__)
    on_disk = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent == PACKAGE
    }
    assert planned == on_disk, (
        f"missing from the plan: {sorted(on_disk - planned)}; "
        f"planned but absent: {sorted(planned - on_disk)}"
    )


@pytest.mark.parametrize("subpackage", sorted(SUBPACKAGES))
def test_each_subpackage_plan_lists_its_modules(subpackage: str) -> None:
    init = PACKAGE / subpackage / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    plan = doc.split("Module plan:", 1)[1]
    listed = {line.split()[0] for line in plan.splitlines() if line.startswith("    ")}
    on_disk = {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"}
    assert on_disk <= listed, f"{subpackage}/__init__.py's plan lacks {on_disk - listed}"


def test_contracts_name_every_file_of_the_run_directory() -> None:
    contracts = (REPO / "CONTRACTS.md").read_text()
    section = contracts.split("## The daemon and its ranks", 1)[1].split("\n## ", 1)[0]
    for path in sorted((PACKAGE / "rundir").glob("[!_]*.py")):
        assert f"daemon/rundir/{path.name}" in section, f"CONTRACTS.md does not name {path.name}"
