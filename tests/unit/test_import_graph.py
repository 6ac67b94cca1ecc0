"""The package's modules import one way: the graph of module-level imports has no cycle.

Edges are the ``import``/``from ... import`` statements at module level (``if
TYPE_CHECKING:`` blocks included: a type-only cycle is still two modules that each need the
other), read with ``ast`` without importing anything. Imports inside functions are left out:
they are the documented exceptions that break a real cycle or defer a heavy import. A
package's own ``__init__`` running before its submodules is not an edge either (it would make
every module depend on ``torch_sagemaker/__init__.py``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torch_sagemaker"
#: Compiled modules of the package: they import no Python module of it, so they end a path.
EXTENSIONS = {"torch_sagemaker._C"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements outside functions and classes (inside if/try blocks too)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, function-local ones included."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph(function_local: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level (or anywhere)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in _all_imports(tree) if function_local else _top_level_imports(tree):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
                candidates = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                    if f"{base}.{a.name}" not in EXTENSIONS
                ]
            for candidate in candidates:
                if candidate == "torch_sagemaker" or candidate.startswith("torch_sagemaker."):
                    target = resolve(candidate)
                    if target and target != name:
                        targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "torch_sagemaker.offload.engine" in graph  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_function_local_imports_hide_no_cycle_either():
    """Function-local imports defer a heavy import or reach the compiled extension; none may
    stand in for a module-level import that would close a cycle (``atomic_dir`` and
    ``s3_checkpoint`` imported each other that way until the checkpoint location protocol)."""
    graph = import_graph(function_local=True)
    assert "torch_sagemaker.checkpoint.location" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle through function-local imports: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
    ],
)
def test_cycle_finder(graph, has_cycle):
    assert (find_cycle(graph) is not None) is has_cycle


def test_graph_sees_type_checking_imports(tmp_path, monkeypatch):
    """An ``if TYPE_CHECKING:`` import counts (the offload engine/hooks cycle was one)."""
    pkg = tmp_path / "torch_sagemaker"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from torch_sagemaker import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from torch_sagemaker.a import A\n\ndef f():\n"
        "    from torch_sagemaker import a\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = import_graph()
    assert graph["torch_sagemaker.a"] == {"torch_sagemaker.b"}
    assert graph["torch_sagemaker.b"] == {"torch_sagemaker.a"}
    assert find_cycle(graph) == ["torch_sagemaker.a", "torch_sagemaker.b", "torch_sagemaker.a"]


def test_the_library_imports_neither_the_planner_nor_the_benchmarks():
    """The planner sits above the library: no other part of the package imports it."""
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("torch_sagemaker.planner"):
            continue
        assert not [t for t in targets if t.startswith("torch_sagemaker.planner")], module
    assert "torch_sagemaker.planner.cost_model" in graph  # the planner's own cost model


def _every_import(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_never_imports_the_benchmarks_or_tools():
    """``benchmarks/`` and ``tools/`` are not installed: no import of the package may need
    them, not even one deferred into a function (the wheel would fail there)."""
    offenders = {
        name: sorted(found)
        for name, path in _modules().items()
        if (found := _every_import(path) & {"benchmarks", "tools", "tests"})
    }
    assert offenders == {}
    assert not [m for m in _modules() if m.startswith("torch_sagemaker.bench")]


def test_every_import_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    from benchmarks import training\n")
    assert _every_import(path) == {"os", "benchmarks"}
