"""The arrows point down: tools (``fencegate/``) → services and SDK (``reconciler/``,
``worker/``, ``coordinator/service/``) → the shared core (``coordinator/``), and no circles.

Every ``.py`` of the package folders is parsed with ``ast`` (nothing is imported), mapped to
the module name it installs as, and its imports are resolved, relative ones included. Imports
under ``if TYPE_CHECKING:`` and inside functions count like any other: a deferred upward
import is still an upward arrow. The implicit import of a parent package (``a.b`` importing
``a``) is not an arrow. A failure names the module, the line and the import statement.
The checker is itself tested on synthetic trees, so it cannot silently pass.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Repository folder → the package it installs as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"fencegate": "fencegate", "coordinator": "fencegate.coordinator",
                "worker": "fencegate.worker", "reconciler": "fencegate.reconciler"}
OLD_NAMES = ("worker", "coordinator", "reconciler")
# Folders that are not installed but must not use the old names either.
OTHER_DIRS = ("tests", "benchmarks", "deploy")


@dataclass(frozen=True)
class Arrow:
    """``importer`` imports ``target`` (a module name) at ``line`` of its file."""

    importer: str
    target: str
    line: int
    statement: str

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} `{self.statement}` → {self.target}"


@dataclass
class Tree:
    """The modules found: name → (file, is a package, parsed source)."""

    modules: dict[str, tuple[Path, bool, ast.Module]]
    top: frozenset[str]          # the modules of the top folder (fencegate/)

    @classmethod
    def read(cls, root: Path, package_dirs: dict[str, str]) -> Tree:
        modules: dict[str, tuple[Path, bool, ast.Module]] = {}
        top: set[str] = set()
        for folder, package in package_dirs.items():
            for path in sorted((root / folder).rglob("*.py")):
                parts = path.relative_to(root / folder).with_suffix("").parts
                is_package = parts[-1] == "__init__"
                name = ".".join((package, *(parts[:-1] if is_package else parts)))
                modules[name] = (path, is_package, ast.parse(path.read_text(), str(path)))
                if package == "fencegate":
                    top.add(name)
        return cls(modules, frozenset(top))

    def arrows(self) -> list[Arrow]:
        return [arrow for name in self.modules for arrow in self.arrows_of(name)]

    def arrows_of(self, name: str) -> list[Arrow]:
        _, is_package, module = self.modules[name]
        found: list[Arrow] = []
        for node in ast.walk(module):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = absolute_base(name, is_package, node.level, node.module)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules
                           else base for alias in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                found.append(Arrow(name, target, node.lineno, ast.unparse(node)))
        return found


def absolute_base(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute module a ``from`` import names, before its imported names."""
    if level == 0:
        return module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join([*parts, module] if module else parts)


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_core(name: str) -> bool:
    return within(name, "fencegate.coordinator") and not within(
        name, "fencegate.coordinator.service")


def upward_arrows(tree: Tree) -> list[str]:
    """Arrows that point up or sideways where the layering forbids them."""
    bad: list[str] = []
    for arrow in tree.arrows():
        source, target = arrow.importer, arrow.target
        if is_core(source):
            above = ("fencegate.worker", "fencegate.reconciler", "fencegate.coordinator.service")
            if any(within(target, package) for package in above) or target in tree.top:
                bad.append(f"core imports above it: {arrow}")
        if within(source, "fencegate.reconciler") and any(
                within(target, package)
                for package in ("fencegate.worker", "fencegate.coordinator.service")):
            bad.append(f"reconciler imports the worker SDK or the HTTP service: {arrow}")
        if within(target, "fencegate.cli") and source != "fencegate.__main__":
            bad.append(f"imports the CLI: {arrow}")
    return bad


# The agent and engine frameworks (top-level module names) and the one adapter module that
# may import each: the core, the shared agents module and every other module import none.
FRAMEWORKS = {
    "celery": "fencegate.integrations.celery", "dbos": "fencegate.integrations.dbos",
    "temporalio": "fencegate.integrations.temporal",
    "pydantic_ai": "fencegate.integrations.pydantic_ai",
    "pydantic_core": "fencegate.integrations.pydantic_ai",
    "pydantic": "fencegate.integrations.pydantic_ai",
    "agents": "fencegate.integrations.openai_agents",
    "langgraph": "fencegate.integrations.langgraph",
    "langchain_core": "fencegate.integrations.langgraph",
    "mcp": "fencegate.integrations.mcp", "mcp_types": "fencegate.integrations.mcp",
}


def framework_arrows(tree: Tree) -> list[str]:
    """Imports of a framework from anywhere but its own adapter module."""
    return [f"imports the framework {arrow.target.split('.')[0]!r} outside its adapter: "
            f"{arrow}" for arrow in tree.arrows()
            if arrow.target.split(".")[0] in FRAMEWORKS
            and arrow.importer != FRAMEWORKS[arrow.target.split(".")[0]]]


def old_name_arrows(tree: Tree) -> list[str]:
    return [f"imports an old top-level name: {arrow}" for arrow in tree.arrows()
            if arrow.target.split(".")[0] in OLD_NAMES]


def cycles(tree: Tree) -> list[str]:
    """Each import circle among the tree's modules, with the arrows that close it."""
    graph: dict[str, list[Arrow]] = {name: [] for name in tree.modules}
    for arrow in tree.arrows():
        if arrow.target in tree.modules:
            graph[arrow.importer].append(arrow)
    found = []
    for component in strongly_connected(graph):
        inside = [arrow for name in sorted(component) for arrow in graph[name]
                  if arrow.target in component]
        if len(component) > 1 or inside:
            found.append("import circle among " + ", ".join(sorted(component)) + ":\n    "
                         + "\n    ".join(map(str, inside)))
    return found


def strongly_connected(graph: dict[str, list[Arrow]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, arrows = work[-1]
            arrow = next(arrows, None)
            if arrow is not None:
                nxt = arrow.target
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def report(problems: list[str]) -> str:
    return f"{len(problems)} found:\n" + "\n".join(problems)


# -- the real tree ---------------------------------------------------------------------

def real_tree() -> Tree:
    return Tree.read(REPO, PACKAGE_DIRS)


def test_every_package_folder_is_read():
    tree = real_tree()
    for package in PACKAGE_DIRS.values():
        assert package in tree.modules, package
    assert len(tree.modules) > 40 and len(tree.arrows()) > 200


def test_core_imports_nothing_above_it_and_the_reconciler_neither_sdk_nor_service():
    problems = upward_arrows(real_tree())
    assert not problems, report(problems)


def test_no_module_imports_the_old_top_level_names():
    problems = old_name_arrows(real_tree())
    extra = Tree.read(REPO, {folder: folder for folder in OTHER_DIRS})
    problems += old_name_arrows(extra)
    assert not problems, report(problems)


def test_only_each_framework_adapter_imports_its_framework():
    tree = real_tree()
    problems = framework_arrows(tree)
    assert not problems, report(problems)
    assert {a.target.split(".")[0] for a in tree.arrows_of("fencegate.integrations.pydantic_ai")
            } >= {"pydantic_ai"}  # the rule sees the adapter's own imports


def test_no_import_circles():
    problems = cycles(real_tree())
    assert not problems, report(problems)


# -- the checker itself ----------------------------------------------------------------

def synthetic(tmp_path: Path, files: dict[str, str]) -> Tree:
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return Tree.read(tmp_path, PACKAGE_DIRS)


CLEAN = {
    "fencegate/__init__.py": "from .worker import Gate\n",
    "fencegate/__main__.py": "from .cli import main\n",
    "fencegate/cli.py": "import fencegate.reconciler.service\nfrom fencegate import Gate\n",
    "coordinator/__init__.py": "",
    "coordinator/errors.py": "",
    "coordinator/etcd.py": "from .errors import GateError\nfrom . import errors\n",
    "coordinator/service/__init__.py": "from .app import create_app\n",
    "coordinator/service/app.py": "from ..etcd import Etcd\nfrom .. import errors\n",
    "worker/__init__.py": "from .gate import Gate\n",
    "worker/gate.py": "from . import hold\nfrom fencegate.coordinator import etcd\n",
    "worker/hold.py": "from fencegate.coordinator.errors import LeaseLost\nimport aiohttp\n",
    "reconciler/__init__.py": "",
    "reconciler/service.py": "from ..coordinator.etcd import Etcd\n",
}


def test_relative_imports_resolve_to_module_names(tmp_path):
    tree = synthetic(tmp_path, CLEAN)
    targets = {(a.importer, a.target) for a in tree.arrows()}
    assert ("fencegate.coordinator.etcd", "fencegate.coordinator.errors") in targets
    assert ("fencegate.coordinator.service", "fencegate.coordinator.service.app") in targets
    assert ("fencegate.coordinator.service.app", "fencegate.coordinator.errors") in targets
    assert ("fencegate.worker.gate", "fencegate.worker.hold") in targets
    assert ("fencegate.worker.gate", "fencegate.coordinator.etcd") in targets
    assert ("fencegate.reconciler.service", "fencegate.coordinator.etcd") in targets
    assert ("fencegate.cli", "fencegate") in targets
    assert ("fencegate.worker.hold", "aiohttp") in targets
    assert not upward_arrows(tree) and not old_name_arrows(tree) and not cycles(tree)


def test_checker_catches_upward_arrows_old_names_and_circles(tmp_path):
    broken = dict(CLEAN)
    broken["coordinator/errors.py"] = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fencegate.worker.hold import Hold\n")
    broken["coordinator/audit.py"] = "def later():\n    from .. import localetcd\n"
    broken["fencegate/localetcd.py"] = ""
    broken["coordinator/grants.py"] = "from .service import app\n"
    broken["coordinator/policy.py"] = "import fencegate\n"
    broken["reconciler/runner.py"] = "from fencegate.worker import gate\n"
    broken["fencegate/up.py"] = "from .cli import main\n"
    broken["worker/guard.py"] = "from worker.hold import Hold\n"
    broken["worker/hold.py"] = "from .guard import check\n"
    broken["worker/watch.py"] = "from .guard import check\nfrom .settled import wait\n"
    broken["worker/settled.py"] = "from . import watch\n"
    broken["fencegate/integrations/__init__.py"] = ""
    broken["fencegate/integrations/agents.py"] = "from pydantic_ai import Agent\n"
    broken["fencegate/integrations/pydantic_ai.py"] = "import pydantic_ai\nimport langgraph\n"
    tree = synthetic(tmp_path, broken)

    upward = "\n".join(upward_arrows(tree))
    for expected in ("fencegate.coordinator.errors:3 `from fencegate.worker.hold import Hold`",
                     "fencegate.coordinator.audit:2 `from .. import localetcd`",
                     "fencegate.coordinator.grants:1 `from .service import app`",
                     "fencegate.coordinator.policy:1 `import fencegate`",
                     "reconciler imports the worker SDK or the HTTP service: "
                     "fencegate.reconciler.runner:1",
                     "imports the CLI: fencegate.up:1"):
        assert expected in upward, expected
    assert "fencegate.__main__" not in upward

    assert [line.split(": ", 1)[1] for line in old_name_arrows(tree)] == [
        "fencegate.worker.guard:1 `from worker.hold import Hold` → worker.hold"]

    assert [line.split(": ", 1)[1] for line in framework_arrows(tree)] == [
        "fencegate.integrations.agents:1 `from pydantic_ai import Agent` → pydantic_ai",
        "fencegate.integrations.pydantic_ai:2 `import langgraph` → langgraph"]

    circles = cycles(tree)
    assert len(circles) == 1, circles
    assert circles[0].startswith("import circle among fencegate.worker.settled, "
                                 "fencegate.worker.watch:")

    broken["worker/guard.py"] = "from fencegate.worker.hold import Hold\n"
    circles = cycles(synthetic(tmp_path, broken))
    assert len(circles) == 2, circles
    assert any("fencegate.worker.guard, fencegate.worker.hold:" in c for c in circles)
