"""The package's layering, read from the source with `ast` (no module is imported): no import cycles,
at any level (function-level imports included: they are deferred, not absent); the model adapters do
not reach into the profiler; the accountant and the registry import no torch; the library imports
no CLI. Imports under `if TYPE_CHECKING:` are for type checkers only and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ficoco", "ficoco_cli")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imported_names(tree: ast.AST) -> set[str]:
    """Every dotted name imported anywhere in `tree`, outside `if TYPE_CHECKING:` blocks."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _dependencies(name: str) -> set[str]:
    """The package modules `name` imports, with the packages whose `__init__` such an import runs
    (but not `name`'s own packages: they are loaded before it)."""
    found = set()
    for imported in _imported_names(ast.parse(MODULES[name].read_text())):
        while imported and imported not in MODULES:
            imported = imported.rpartition(".")[0]
        while imported:
            if imported != name and not name.startswith(imported + "."):
                found.add(imported)
            imported = imported.rpartition(".")[0]
    return {module for module in found if module in MODULES}


GRAPH = {name: _dependencies(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_package_has_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    graph = {**GRAPH, "ficoco.accounting.flops": GRAPH["ficoco.accounting.flops"] | {"ficoco.profiling.verify"}}
    assert any("ficoco.profiling.verify" in component and "ficoco.accounting.flops" in component
               for component in _cycles(graph))


def test_a_function_level_import_counts() -> None:
    tree = ast.parse("def f():\n    from ficoco.profiling import runs\n"
                     "if TYPE_CHECKING:\n    from ficoco.verify import Verification\n")
    assert _imported_names(tree) == {"ficoco.profiling", "ficoco.profiling.runs"}


def _reaches(start: str, prefix: str) -> list[str]:
    return sorted(module for module in GRAPH[start] if module == prefix or module.startswith(prefix + "."))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ficoco.models")))
def test_the_model_adapters_do_not_import_the_profiler(module: str) -> None:
    assert _reaches(module, "ficoco.profiling") == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ficoco.")))
def test_the_library_imports_no_cli(module: str) -> None:
    assert _reaches(module, "ficoco_cli") == []


TORCH_FREE = ("ficoco.accounting", "ficoco.methods.base", "ficoco.methods.registry", "ficoco.methods.contract",
              "ficoco.methods.ficoco_costs", "ficoco.profiles", "ficoco.profile_records", "ficoco.report.flops")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(TORCH_FREE)))
def test_the_accountant_and_the_registry_import_no_torch_at_module_level(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    top_level = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    names = _imported_names(ast.Module(body=top_level, type_ignores=[]))
    assert not {name for name in names if name.split(".")[0] == "torch"}
