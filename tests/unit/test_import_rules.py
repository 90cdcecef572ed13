"""The import rules of the product packages, checked statically (ast; nothing is imported).

Every `.py` under kvfleet/, engine/, router/, tokenizer_svc/ and kernels/ is parsed, and every
import in it counts: module level, inside functions, under `if TYPE_CHECKING:`, relative ones,
and `importlib.import_module("literal")`. The rules:

(a) a service (engine, router, tokenizer_svc) never imports another service's modules; they
    talk over gRPC and share only the layers below;
(b) the shared layers (kvfleet.contracts, kvfleet.text, kvfleet.runtime, kvfleet.v1) import no
    service and not the launcher (kvfleet.cli, kvfleet.fleet, kvfleet.redis_server,
    kvfleet.run_logs, kvfleet.router_client);
(c) no import cycle among modules;
(d) router/ keeps at most ROUTER_TOP_LEVEL_MAX modules directly in it (__init__ counted); the
    rest live in its packages (http, openai, tenancy, routing, engines).

An edge is drawn to the module an import names: `from a.b import c` is an edge to the module
a.b.c when c is a module, else to a.b (a name defined there); `import a.b.c` is one to a.b.c.
Failure messages list every offender: the importing module, its line, the imported module.
The tests at the end run the same checker on planted trees, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("kvfleet", "engine", "router", "tokenizer_svc", "kernels")
SERVICES = ("engine", "router", "tokenizer_svc")
SHARED_LAYERS = ("kvfleet.contracts", "kvfleet.text", "kvfleet.runtime", "kvfleet.v1")
LAUNCHER = ("kvfleet.cli", "kvfleet.fleet", "kvfleet.redis_server", "kvfleet.run_logs",
            "kvfleet.router_client")
ROUTER_TOP_LEVEL_MAX = 12


@dataclass(frozen=True)
class Edge:
    """`importer` imports `imported` (both product modules) at `line` of importer's file."""

    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}"


@dataclass(repr=False)
class ImportGraph:
    modules: dict[str, Path]  # dotted name -> file
    edges: list[Edge] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"ImportGraph({len(self.modules)} modules, {len(self.edges)} imports)"

    def first_line(self, importer: str, imported: str) -> int:
        return min(e.line for e in self.edges if (e.importer, e.imported) == (importer, imported))

    def successors(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for edge in self.edges:
            if edge.imported != edge.importer:
                out[edge.importer].add(edge.imported)
        return out


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` (directories under `root`), by dotted name."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(root, path)] = path
    return modules


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """(module named, name imported from it or None) for one import-like node."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            # The package the relative import starts from: a package's __init__ is its own.
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        return [(source, alias.name) for alias in node.names]
    if (isinstance(node, ast.Call) and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        func = node.func
        called = (func.attr if isinstance(func, ast.Attribute)
                  else func.id if isinstance(func, ast.Name) else "")
        if called in ("import_module", "__import__"):
            return [(node.args[0].value, None)]
    return []


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The product module `name` is, or the nearest enclosing one; None outside the product."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def build_graph(root: Path, packages: Iterable[str] = PRODUCT_PACKAGES) -> ImportGraph:
    graph = ImportGraph(discover(root, packages))
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):  # every import: module level, functions, TYPE_CHECKING
            for source, name in _imported_names(node, module, is_package):
                target = None
                if name is not None and name != "*" and f"{source}.{name}" in graph.modules:
                    target = f"{source}.{name}"  # `from package import submodule`
                else:
                    target = _resolve(source, graph.modules)
                if target is not None and target != module:
                    graph.edges.append(Edge(module, target, getattr(node, "lineno", 0)))
    return graph


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _top(module: str) -> str:
    return module.split(".")[0]


def cross_service_imports(graph: ImportGraph) -> list[Edge]:
    """Rule (a): edges from one service's module to another service's."""
    return sorted(
        (e for e in graph.edges
         if _top(e.importer) in SERVICES and _top(e.imported) in SERVICES
         and _top(e.importer) != _top(e.imported)),
        key=str,
    )


def shared_layer_violations(graph: ImportGraph) -> list[Edge]:
    """Rule (b): edges from a shared-layer module to a service or the launcher."""
    return sorted(
        (e for e in graph.edges
         if _within(e.importer, SHARED_LAYERS)
         and (_top(e.imported) in SERVICES or _within(e.imported, LAUNCHER))),
        key=str,
    )


def import_cycles(graph: ImportGraph) -> list[list[str]]:
    """Rule (c): each strongly connected set of modules with more than one (sorted), as a
    cycle through all of them where one is found quickly, else as the sorted set."""
    successors = graph.successors()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    # Iterative Tarjan (no recursion limit on deep graphs).
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(successors.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def cycle_path(graph: ImportGraph, component: list[str]) -> list[str]:
    """One cycle inside a strongly connected `component`: [m0, m1, ..., m0] (shortest from m0)."""
    successors = graph.successors()
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(successors.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child in members and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def router_top_level(root: Path) -> list[str]:
    """Rule (d)'s count: the modules directly in router/ (__init__ included)."""
    return sorted(path.name for path in (root / "router").glob("*.py"))


def assert_no_cross_service_imports(graph: ImportGraph) -> None:
    offenders = cross_service_imports(graph)
    assert not offenders, "a service imports another service's modules:\n" + "\n".join(
        f"  {edge}" for edge in offenders)


def assert_shared_layers_clean(graph: ImportGraph) -> None:
    offenders = shared_layer_violations(graph)
    assert not offenders, (
        "a shared layer (kvfleet.contracts/text/runtime/v1) imports a service or the launcher:\n"
        + "\n".join(f"  {edge}" for edge in offenders))


def assert_no_import_cycles(graph: ImportGraph) -> None:
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (modules; one cycle through them, module:line):\n" + (
        "\n".join(f"  {component}: {describe_cycle(graph, component)}" for component in cycles))


def describe_cycle(graph: ImportGraph, component: list[str]) -> str:
    path = cycle_path(graph, component)
    steps = [f"{a}:{graph.first_line(a, b)}" for a, b in zip(path, path[1:], strict=False)]
    return " -> ".join([*steps, path[-1]])


def assert_router_top_level_small(root: Path) -> None:
    files = router_top_level(root)
    assert len(files) <= ROUTER_TOP_LEVEL_MAX, (
        f"router/ has {len(files)} top-level modules (at most {ROUTER_TOP_LEVEL_MAX}; move some "
        f"into its packages): {', '.join(files)}")


# -- the rules on the product tree -----------------------------------------------------------


@pytest.fixture(scope="module")
def product() -> ImportGraph:
    return build_graph(REPO_ROOT)


def test_the_product_packages_are_found(product: ImportGraph) -> None:
    for package in PRODUCT_PACKAGES:
        assert package in product.modules, f"no {package}/__init__.py under {REPO_ROOT}"
    assert len(product.edges) > 100  # the walk saw the imports


def test_no_service_imports_another(product: ImportGraph) -> None:
    assert_no_cross_service_imports(product)


def test_shared_layers_import_no_service_or_launcher(product: ImportGraph) -> None:
    assert_shared_layers_clean(product)


def test_no_import_cycles(product: ImportGraph) -> None:
    assert_no_import_cycles(product)


def test_router_top_level_stays_small() -> None:
    assert_router_top_level_small(REPO_ROOT)


# -- the checker on planted trees ------------------------------------------------------------


def plant(root: Path, files: Mapping[str, str]) -> Path:
    """Write `files` (path -> source) under `root`, with an empty __init__.py in every package
    directory that lacks one."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for relative in list(files):
        for parent in Path(relative).parents:
            if parent != Path(".") and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
    return root


CLEAN = {
    "kvfleet/contracts/errors.py": "import grpc\n",
    "kvfleet/runtime/server.py": "from kvfleet.contracts import errors\n",
    "kvfleet/fleet.py": "from kvfleet.runtime.server import x\nimport engine.llm\n",
    "engine/llm.py": "from .core import step\nfrom kvfleet.contracts.errors import E\n",
    "engine/core/step.py": "from ..config import Config\n",
    "engine/config.py": "import os\n",
    "router/server.py": "from router.routing import rank\nfrom kvfleet.v1 import pb\n",
    "router/routing/rank.py": "from typing import TYPE_CHECKING\n",
    "kvfleet/v1/pb.py": "",
    "tokenizer_svc/server.py": "from kvfleet.runtime import server\n",
    "kernels/cpu.py": "",
}


def graph_of(tmp_path: Path, extra: Mapping[str, str] = {}) -> ImportGraph:  # noqa: B006
    return build_graph(plant(tmp_path, {**CLEAN, **extra}))


def test_a_clean_tree_passes_every_rule(tmp_path: Path) -> None:
    graph = graph_of(tmp_path)
    assert cross_service_imports(graph) == []
    assert shared_layer_violations(graph) == []
    assert import_cycles(graph) == []
    edges = {(e.importer, e.imported) for e in graph.edges}
    # Relative imports resolve; `from package import submodule` names the submodule.
    assert ("engine.llm", "engine.core.step") in edges
    assert ("engine.core.step", "engine.config") in edges
    assert ("router.server", "router.routing.rank") in edges
    assert ("kvfleet.fleet", "kvfleet.runtime.server") in edges


def test_a_planted_cycle_is_caught_even_through_functions_and_type_checking(
    tmp_path: Path,
) -> None:
    graph = graph_of(tmp_path, {
        "engine/core/step.py": "from ..config import Config\n",
        "engine/config.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from engine.spec import draft\n"),
        "engine/spec/draft.py": "def build():\n    from engine.core.step import run\n",
    })
    assert import_cycles(graph) == [["engine.config", "engine.core.step", "engine.spec.draft"]]
    path = cycle_path(graph, import_cycles(graph)[0])
    assert path[0] == path[-1] and set(path) == {
        "engine.config", "engine.core.step", "engine.spec.draft"}
    with pytest.raises(AssertionError, match=r"engine\.config.*engine\.spec\.draft"):
        assert_no_import_cycles(graph)


def test_a_two_module_cycle_and_import_module_literals_are_caught(tmp_path: Path) -> None:
    graph = graph_of(tmp_path, {
        "router/tenancy/keys.py": "from router.tenancy.policy import P\n",
        "router/tenancy/policy.py": (
            "import importlib\n"
            "def load():\n    return importlib.import_module('router.tenancy.keys')\n"),
    })
    assert import_cycles(graph) == [["router.tenancy.keys", "router.tenancy.policy"]]


def test_a_cross_service_import_is_caught(tmp_path: Path) -> None:
    graph = graph_of(tmp_path, {
        "router/server.py": "def f():\n    import engine.core.step\n",
        "tokenizer_svc/server.py": "from router import server\n",
    })
    assert [str(e) for e in cross_service_imports(graph)] == [
        "router.server:2 -> engine.core.step", "tokenizer_svc.server:1 -> router.server"]
    with pytest.raises(AssertionError, match=r"router\.server:2 -> engine\.core\.step"):
        assert_no_cross_service_imports(graph)


def test_a_shared_layer_importing_a_service_or_the_launcher_is_caught(tmp_path: Path) -> None:
    graph = graph_of(tmp_path, {
        "kvfleet/contracts/errors.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from router.server import Router\n"),
        "kvfleet/text/chat.py": "from ..fleet import FleetConfig\n",
        "kvfleet/runtime/server.py": "from kvfleet import run_logs\n",
        "kvfleet/run_logs.py": "",
    })
    assert [str(e) for e in shared_layer_violations(graph)] == [
        "kvfleet.contracts.errors:3 -> router.server",
        "kvfleet.runtime.server:1 -> kvfleet.run_logs",
        "kvfleet.text.chat:1 -> kvfleet.fleet",
    ]
    with pytest.raises(AssertionError, match=r"kvfleet\.text\.chat:1 -> kvfleet\.fleet"):
        assert_shared_layers_clean(graph)


def test_a_crowded_router_top_level_is_caught(tmp_path: Path) -> None:
    plant(tmp_path, {**CLEAN, **{f"router/m{i}.py": "" for i in range(11)}})
    assert len(router_top_level(tmp_path)) == 13  # __init__, server and m0..m10
    with pytest.raises(AssertionError, match=r"13 top-level modules.*m10\.py"):
        assert_router_top_level_small(tmp_path)
