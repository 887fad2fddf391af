"""The layers of the house, read from the source: no import circle, no import up the layers.

Every import counts, wherever it sits: at the top of a module, inside a
function (a lazy import is still a dependency) and under TYPE_CHECKING (a
type-only circle is still a circle). Modules are read, not imported, so a
circle is found even where Python happens to tolerate it. The folders come
from pyproject's package-dir (broker/ is fencemq, cli/ fencemq.cli, …), plus
the bench.

The layers, top uses bottom (docs/architecture.md)::

    cli                                      spark (ships alone)
    ui         (the web UI: presentation over ops, like cli; a door of the server's gate)
    server                                   bench (anything, but no circle)
    ops        sdk (model and errors only; the package root is its façade)
    fences     (+ the lua package data)
    protocol
    model
    errors, config
"""

from __future__ import annotations

import ast
import tomllib
from functools import cached_property
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
BELOW_FENCES = {"protocol", "model", "errors", "config"}
# What each layer may import besides itself.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "model": {"errors", "config"},
    "protocol": {"model", "errors", "config"},
    "fences": {"lua"} | BELOW_FENCES,
    "ops": {"fences", "lua"} | BELOW_FENCES,
    "sdk": {"model", "errors"},
    "facade": {"sdk"},  # the package root: ``from fencemq import Client``, and the version
    "server": {"ops", "sdk", "facade", "fences", "lua"} | BELOW_FENCES,
    # the web UI: presents broker/ops/, as the CLI does, behind the server's gate (server/gate.py)
    "ui": {"server", "ops", "fences", "lua"} | BELOW_FENCES,
    "cli": {"server", "ui", "ops", "sdk", "facade", "fences", "lua", "spark"} | BELOW_FENCES,
    "spark": set(),
    "lua": set(),
}
MAY_IMPORT["bench"] = set(MAY_IMPORT)  # the bench measures everything; it only must not go in circles


def layer_of(module: str) -> str:
    if module == "fencemq":
        return "facade"
    top, _, rest = module.partition(".")
    if top == "bench":
        return "bench"
    return rest.partition(".")[0]


class ImportGraph:
    """The project's modules, read from a checkout, and which of them each one imports."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @cached_property
    def modules(self) -> dict[str, Path]:
        """Every Python module by its dotted name (a package by its own name)."""
        pyproject = tomllib.loads((self.root / "pyproject.toml").read_text())
        folders = dict(pyproject["tool"]["setuptools"]["package-dir"])
        if (self.root / "bench").is_dir():
            folders["bench"] = "bench"
        found: dict[str, Path] = {}
        for package, folder in folders.items():
            for path in (self.root / folder).rglob("*.py"):
                parts = [p for p in path.relative_to(self.root / folder).with_suffix("").parts if p != "__init__"]
                found[".".join([package, *parts])] = path
        return found

    @cached_property
    def imports(self) -> dict[str, frozenset[str]]:
        """Module → the project's modules it imports, anywhere in its source."""
        graph: dict[str, frozenset[str]] = {}
        for name, path in self.modules.items():
            tree = ast.parse(path.read_text(), filename=str(path))
            landed = (self._nearest_module(n) for n in self._imported_names(name, path, tree))
            graph[name] = frozenset(m for m in landed if m is not None)
        return graph

    def _imported_names(self, name: str, path: Path, tree: ast.AST) -> list[str]:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from a import b`` imports the module a.b when there is one, else a name of a
                names += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else base
                          for alias in node.names]
        return names

    def _nearest_module(self, imported: str) -> str | None:
        """The project module an imported name lands in (``a.b.c`` that is no module: ``a.b``), or None."""
        while imported:
            if imported in self.modules:
                return imported
            imported = imported.rpartition(".")[0]
        return None

    def circles(self) -> list[list[str]]:
        """Every import circle: the strongly connected parts of the graph (Tarjan), a self-import included."""
        graph = self.imports
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        found: list[list[str]] = []

        def visit(module: str) -> None:
            index[module] = low[module] = len(index)
            stack.append(module)
            for imported in sorted(graph[module]):
                if imported not in index:
                    visit(imported)
                    low[module] = min(low[module], low[imported])
                elif imported in stack:
                    low[module] = min(low[module], index[imported])
            if low[module] == index[module]:
                part = stack[stack.index(module):]
                del stack[stack.index(module):]
                if len(part) > 1 or module in graph[module]:
                    found.append(sorted(part))

        for module in sorted(graph):
            if module not in index:
                visit(module)
        return found

    def circles_through(self, layer: str) -> list[list[str]]:
        return [circle for circle in self.circles() if any(layer_of(m) == layer for m in circle)]

    def upward_imports(self, layer: str) -> list[str]:
        allowed = MAY_IMPORT[layer] | {layer}
        return sorted(
            f"{module} imports {imported}"
            for module, imported_modules in self.imports.items() if layer_of(module) == layer
            for imported in imported_modules if layer_of(imported) not in allowed
        )


PROJECT = ImportGraph(REPOSITORY)

# A known, not yet fixed violation is marked here (strict: it goes red the day it is fixed). None now.
KNOWN_CIRCLES: dict[str, str] = {}
KNOWN_UPWARD_IMPORTS: dict[str, str] = {}


def _layers(known: dict[str, str]) -> list:
    return [pytest.param(layer, marks=pytest.mark.xfail(strict=True, reason=known[layer])) if layer in known
            else layer for layer in MAY_IMPORT]


# -- the project --------------------------------------------------------------------------


def test_every_module_belongs_to_a_known_layer():
    assert {m: layer_of(m) for m in PROJECT.modules if layer_of(m) not in MAY_IMPORT} == {}


def test_the_graph_sees_the_imports_of_the_server():
    # a graph that read nothing would find no circle: make sure it reads
    assert {"fencemq.server.connection", "fencemq.server.services"} <= PROJECT.imports["fencemq.server.worker"]
    assert "fencemq.server.worker" not in PROJECT.imports["fencemq.server.connection"]


@pytest.mark.parametrize("layer", _layers(KNOWN_CIRCLES))
def test_no_module_of_a_layer_sits_in_an_import_circle(layer):
    assert PROJECT.circles_through(layer) == []


@pytest.mark.parametrize("layer", _layers(KNOWN_UPWARD_IMPORTS))
def test_a_layer_imports_only_the_layers_below_it(layer):
    assert PROJECT.upward_imports(layer) == []


# -- the walker itself, on planted trees ------------------------------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> ImportGraph:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\nfencemq = "broker"\n')
    for name, text in {"broker/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return ImportGraph(tmp_path)


def test_a_circle_closed_only_under_type_checking_is_a_circle(tmp_path):
    graph = _plant(tmp_path, {
        "broker/server/__init__.py": "",
        "broker/server/worker.py": "from fencemq.server.connection import ClientConnection\n",
        "broker/server/connection.py": "from typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from fencemq.server.worker import Worker\n",
    })
    assert graph.circles() == [["fencemq.server.connection", "fencemq.server.worker"]]


def test_a_circle_closed_inside_a_function_or_by_a_relative_import_is_a_circle(tmp_path):
    graph = _plant(tmp_path, {
        "broker/fences/__init__.py": "",
        "broker/fences/a.py": "def f():\n    from . import b\n",
        "broker/fences/b.py": "from .c import thing\n",
        "broker/fences/c.py": "import fencemq.fences.a\nthing = 1\n",
    })
    assert graph.circles_through("fences") == [["fencemq.fences.a", "fencemq.fences.b", "fencemq.fences.c"]]


def test_an_import_up_the_layers_is_named(tmp_path):
    graph = _plant(tmp_path, {
        "broker/model/__init__.py": "",
        "broker/model/keys.py": "from fencemq.protocol.resp import encode\n",
        "broker/protocol/__init__.py": "",
        "broker/protocol/resp.py": "from fencemq.model import keys\ndef encode(): ...\n",
    })
    assert graph.upward_imports("model") == ["fencemq.model.keys imports fencemq.protocol.resp"]
    assert graph.upward_imports("protocol") == []
