"""The package's layering, read from the source with `ast` (no module is imported): no import cycles,
at any level (function-level imports included: they are deferred, not absent; imports by string
included: ``importlib.import_module("pkg.mod")`` with a literal name, and a string constant that names
a package module, ``"pkg.mod"`` or ``"pkg.mod:function"``, which some code imports on use); the model
adapters do not reach into the profiler; the accountant and the method specs import no torch; the
library imports no CLI. Imports under `if TYPE_CHECKING:` are for type checkers only and are left out."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ficoco", "ficoco_cli")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()
# A string that may name a module to import on use: "pkg.mod" or "pkg.mod:attribute".
_STRING_TARGET = re.compile(r"[A-Za-z_]\w*(\.\w+)+(:[\w.]+)?")
_IMPORT_CALLS = ("import_module", "__import__")


def _imported_names(tree: ast.AST) -> set[str]:
    """Every dotted name imported anywhere in `tree`, outside `if TYPE_CHECKING:` blocks: import
    statements, and ``importlib.import_module`` / ``__import__`` calls with a literal name."""
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
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in _IMPORT_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
                names.add(first.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _string_targets(tree: ast.AST, modules: set[str] | dict[str, Path]) -> set[str]:
    """The package modules that string constants of `tree` name as import targets, outside `if
    TYPE_CHECKING:` blocks: ``"pkg.mod:function"`` or ``"pkg.mod"`` where ``pkg.mod`` is one of
    `modules` (a planner, an entry point or a lazy table imported on use by whoever reads the string)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _STRING_TARGET.fullmatch(node.value):
            module = node.value.partition(":")[0]
            if module in modules:
                found.add(module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _dependencies(name: str, source: str, modules: set[str] | dict[str, Path], strings: bool = True) -> set[str]:
    """The package modules `name` (whose text is `source`) imports, by statement or (`strings`) by string,
    with the packages whose `__init__` such an import runs (but not `name`'s own packages: they are
    loaded before it)."""
    tree = ast.parse(source)
    found = set()
    for imported in _imported_names(tree) | (_string_targets(tree, modules) if strings else set()):
        while imported and imported not in modules:
            imported = imported.rpartition(".")[0]
        while imported:
            if imported != name and not name.startswith(imported + "."):
                found.add(imported)
            imported = imported.rpartition(".")[0]
    return {module for module in found if module in modules}


def _graph(sources: dict[str, str], strings: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports, for modules given by name and source text."""
    return {name: _dependencies(name, text, sources.keys(), strings) for name, text in sources.items()}


def _sources(root: Path = ROOT) -> dict[str, str]:
    return {name: path.read_text() for name, path in _modules(root).items()}


GRAPH = _graph(_sources())


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


def test_an_import_by_string_counts() -> None:
    tree = ast.parse('import importlib\nimportlib.import_module("ficoco.verify")\n__import__("ficoco.sweep")\n'
                     'importlib.import_module(name)\nimportlib.import_module(".ops", package=__name__)\n'
                     'PLANNER = "ficoco.accounting.schedule:plan_per_layer"\nLAZY = {"run": "ficoco.sweep_worker"}\n'
                     'KEY = "ficoco.text_tokens"  # a settings key: no module of that name\n')
    modules = {"ficoco", "ficoco.accounting", "ficoco.accounting.schedule", "ficoco.sweep_worker"}
    assert _imported_names(tree) == {"importlib", "ficoco.verify", "ficoco.sweep"}
    assert _string_targets(tree, modules) == {"ficoco.accounting.schedule", "ficoco.sweep_worker"}


# The string-import cycle of the tree before issue 33, in its own lines: the spec named its planner by an
# import path ("module:function", imported by importlib on use) while the accountant imported the spec.
BEFORE_ISSUE_33 = {
    "pkg": "",
    "pkg.methods": "",
    "pkg.methods.base": (
        "import importlib\n"
        "class MethodSpec:\n"
        "    planner: str = 'pkg.accounting.methods:plan_by_steps'\n"
        "    def plan(self, arch, request):\n"
        "        module, _, function = self.planner.partition(':')\n"
        "        return getattr(importlib.import_module(module), function)(arch, self, request)\n"),
    "pkg.methods.registry": ("from pkg.methods.base import MethodSpec\n"
                             "_PER_LAYER = 'pkg.accounting.schedule:plan_per_layer'\n"),
    "pkg.accounting": "",
    "pkg.accounting.schedule": ("from pkg.methods.registry import METHODS\n"
                                "def plan_per_layer(arch, spec, request): ...\n"),
    "pkg.accounting.methods": ("from pkg.accounting.schedule import PlanRequest\n"
                               "from pkg.methods.base import MethodSpec\nfrom pkg.methods.registry import method\n"
                               "def plan_by_steps(arch, spec, request): ...\n"),
}


def test_the_cycle_finder_sees_a_cycle_through_a_string_import() -> None:
    (component,) = _cycles(_graph(BEFORE_ISSUE_33))
    assert {"pkg.methods.base", "pkg.accounting.methods"} <= set(component)
    assert {"pkg.methods.registry", "pkg.accounting.schedule"} <= set(component)
    # Read as import statements alone, the same tree shows no cycle (all the check saw before issue 33).
    assert _cycles(_graph(BEFORE_ISSUE_33, strings=False)) == []


def _reaches(start: str, prefix: str) -> list[str]:
    return sorted(module for module in GRAPH[start] if module == prefix or module.startswith(prefix + "."))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ficoco.models")))
def test_the_model_adapters_do_not_import_the_profiler(module: str) -> None:
    assert _reaches(module, "ficoco.profiling") == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ficoco.")))
def test_the_library_imports_no_cli(module: str) -> None:
    assert _reaches(module, "ficoco_cli") == []


TORCH_FREE = ("ficoco.accounting", "ficoco.methods", "ficoco.profiles", "ficoco.profile_records", "ficoco.report.flops")


def _torch_free(module: str) -> bool:
    """The accountant, every method's spec and the methods package's shared modules; not the tensor
    functions (a method's ``ops``, the shared ``ficoco.methods.ops``, and a package named ``ops`` with its
    modules: ``ficoco.methods.reads.ops``)."""
    return module.startswith(TORCH_FREE) and "ops" not in module.split(".")[2:]


def test_every_method_folder_has_a_torch_free_spec_and_its_ops() -> None:
    folders = {m for m in MODULES if m.startswith("ficoco.methods.") and m + ".ops" in MODULES}
    assert {"ficoco.methods.ficoco_v", "ficoco.methods.ficoco_l", "ficoco.methods.fastv"} <= folders
    assert all(_torch_free(folder) and not _torch_free(folder + ".ops") for folder in folders)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _torch_free(m)))
def test_the_accountant_and_the_registry_import_no_torch_at_module_level(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    top_level = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    names = _imported_names(ast.Module(body=top_level, type_ignores=[]))
    assert not {name for name in names if name.split(".")[0] == "torch"}


def _reachable(start: str) -> set[str]:
    """Every package module `start` imports, directly or through others (function-level imports included)."""
    seen: set[str] = set()
    stack = [start]
    while stack:
        for module in GRAPH[stack.pop()]:
            if module not in seen:
                seen.add(module)
                stack.append(module)
    return seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ficoco.serving")))
def test_the_serving_engines_room_never_reaches_the_transformers_adapters(module: str) -> None:
    # The vLLM plugin runs in vLLM's venv, whose transformers is outside ficoco's range: it calls the method ops and
    # the torch-free accountant, never ficoco.models (the layering: neither room imports the other).
    assert sorted(m for m in _reachable(module) if m.startswith("ficoco.models")) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ficoco.models")))
def test_the_transformers_adapters_never_import_the_serving_room(module: str) -> None:
    assert sorted(m for m in _reachable(module) if m.startswith("ficoco.serving")) == []


def test_the_serving_room_is_seen() -> None:
    assert {"ficoco.serving.vllm", "ficoco.serving.vllm.qwen", "ficoco.serving.vllm.settings"} <= set(MODULES)
