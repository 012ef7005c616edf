"""Imports point down the layers written in docs/architecture.md, and no modules import each other in
a loop. The imports are read with `ast` (function-level ones included: a lazy import is still a
dependency). An upward import or a cycle fails here."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kvserve"

# Highest first: a module may import from its own layer and those after it.
LAYERS = (
    "kvserve.cli",
    "kvserve.server",
    "kvserve.llm",
    "kvserve.eval",
    "kvserve.obs",
    "kvserve.engine",
    "kvserve.worker",
    "kvserve.sched",
    "kvserve.model",
    "kvserve.kvcache",
    "kvserve.attention",
    "kvserve.press",
    "kvserve.kernels",
    "kvserve.kvstore",
    "kvserve.sampling_params",
    "kvserve.structured",
    "kvserve.stats",
    "kvserve.config",
    "kvserve.envs",
)

# Upward imports still to be removed, as (importing module, imported module): none left.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# Import cycles still to be broken (issue 24), each as the set of its modules.
KNOWN_CYCLES: list[set[str]] = []


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(imported: str, modules: set[str]) -> str:
    """`from kvserve.a import b` names the module kvserve.a.b when that is one, else kvserve.a."""
    return imported if imported in modules else imported.rsplit(".", 1)[0] if "." in imported else imported


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in ROOT.rglob("*.py"):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if not name.startswith("kvserve."):
                    continue
                target = _resolve(name, modules)
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != importer:
                    graph[importer].add(target)
    return graph


def layer_of(module: str) -> int:
    for index, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and docs/architecture.md")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(importer, target) for importer, targets in graph.items() if importer != "kvserve"
            for target in targets if target != "kvserve" and layer_of(target) < layer_of(importer)}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                if len(component) > 1:
                    found.append(component)
    return found


def test_every_module_is_in_a_layer():
    for module in import_graph():
        if module != "kvserve":
            layer_of(module)


def test_imports_point_down_the_layers():
    upward = upward_imports(import_graph())
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, "imports from a lower layer up to a higher one (docs/architecture.md):\n" + "\n".join(
        f"  {importer} -> {target}" for importer, target in new)
    assert not KNOWN_UPWARD - upward, f"removed, so drop them from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"modules that import each other in a loop: {new}"
    assert all(c in found for c in KNOWN_CYCLES), "a known cycle is gone: drop it from KNOWN_CYCLES"


@pytest.mark.parametrize("graph, expected_upward, expected_cycles", [
    ({"kvserve.engine.a": {"kvserve.server.b"}, "kvserve.server.b": set()}, {("kvserve.engine.a", "kvserve.server.b")}, []),
    ({"kvserve.kvcache.x": {"kvserve.kvcache.y"}, "kvserve.kvcache.y": {"kvserve.kvcache.x"}}, set(),
     [{"kvserve.kvcache.x", "kvserve.kvcache.y"}]),
    ({"kvserve.server.b": {"kvserve.engine.a"}, "kvserve.engine.a": set()}, set(), []),
])
def test_the_checks_catch_what_they_are_for(graph, expected_upward, expected_cycles):
    assert upward_imports(graph) == expected_upward
    assert cycles(graph) == expected_cycles


def test_the_environment_is_read_in_one_module():
    """kvserve/envs.py names every environment variable kvserve reads; nothing else reads os.environ."""
    readers = []
    for path in ROOT.rglob("*.py"):
        if path.name == "envs.py" and path.parent == ROOT:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{_module_name(path)}:{node.lineno}")
    assert not readers, f"read the environment through kvserve.envs instead: {readers}"


def test_the_readme_lists_every_environment_variable():
    from kvserve import envs
    readme = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    missing = [var.name for var in envs.ALL if f"`{var.name}`" not in readme]
    assert not missing, f"README.md's environment table lacks {missing}"
