"""moesub.engine's layout: the package's modules import each other without a cycle (lazy imports
inside functions included), and each stays small enough to read top to bottom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "src" / "moesub" / "engine"
MAX_LINES = 500


def engine_imports(path: Path) -> set[str]:
    """The `moesub.engine` modules `path` imports, anywhere in the file (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "moesub.engine":  # `from moesub.engine import store`
                out |= {a.name for a in node.names if (ENGINE / f"{a.name}.py").is_file()}
            elif node.module.startswith("moesub.engine."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("moesub.engine.")}
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> engine modules it imports (the package's `__init__` re-exports, so it is left
    out: it imports everything and nothing imports it)."""
    return {
        p.stem: engine_imports(p) - {p.stem} for p in ENGINE.glob("*.py") if p.stem != "__init__"
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search)."""
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

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_engine_imports_are_acyclic():
    graph = import_graph()
    assert {"tiers", "cuda_tier", "kernels", "runtime", "adapter", "decode", "stage"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle in moesub.engine: {find_cycle(graph)}"


def test_engine_layers_are_the_documented_order():
    """The package docstring lists the modules lowest layer first; each imports only modules
    listed before it (so the list is the reading order, and stays true)."""
    import re

    doc = ast.get_docstring(ast.parse((ENGINE / "__init__.py").read_text()))
    order = re.findall(r"^- `(\w+)`:", doc, flags=re.M)
    graph = import_graph()
    assert sorted(order) == sorted(graph), "the docstring must list every engine module once"
    for i, module in enumerate(order):
        later = graph[module] - set(order[:i])
        assert not later, f"{module} imports {sorted(later)}, listed after it"


@pytest.mark.parametrize("path", sorted(ENGINE.glob("*.py")), ids=lambda p: p.name)
def test_engine_modules_are_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.name}: {n} lines (> {MAX_LINES}): split it by part"
