"""The layering of moesub: stages use the shared layer, never each other.

A *stage module* is one of STAGES (a module or a package with everything under it); every other
module under `src/moesub` is shared (artefacts, replay, policy, grid, cost, metrics, params, io,
models, corpus, config, logs, synthetic, sandbox, traces, ...). A stage imports shared modules
and its own submodules only; a helper two stages need lives in the shared layer. Shared modules
import no stage at run time (an annotation-only import under `TYPE_CHECKING` is allowed).

One stage uses another as what it is, not for a helper: generation decodes through the offload
engine (its time per token is the point), so `generate -> engine` is the one allowed edge.

No module imports itself through others: the import graph has no cycle, annotation-only imports
included (a cycle hidden under `TYPE_CHECKING` is still two modules that need each other).

The config (what the Snakefile runs at parse time) loads the policy vocabulary
(`moesub.vocabulary`), never the C++ policy core or torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moesub"
STAGES = frozenset(
    {
        "streams", "capture", "simulate", "emulate", "regime", "expb", "generate", "engine",
        "stats", "recommend", "plan", "report", "embedded", "price",
    }
)  # fmt: skip
USES = frozenset({("generate", "engine")})  # (stage, the stage it runs)


def module_name(path: Path) -> str:
    parts = ["moesub", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "moesub" and parts[1] in STAGES else None


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def imports(path: Path, members: bool = False) -> list[tuple[int, str, bool]]:
    """(line, imported module, annotation-only) for every import in the file, at any depth;
    with `members`, `from m import a` gives `m.a` (the module m.a or a name in m)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = _type_checking_blocks(tree)
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package[: len(package) - node.level + 1]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module or ""]
            # `from moesub import capture` imports the module moesub.capture
            if members or names == ["moesub"]:
                names = [f"{names[0]}.{a.name}" for a in node.names]
        else:
            continue
        out += [(node.lineno, name, id(node) in typing_only) for name in names]
    return out


def violations() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        here = stage_of(module_name(path))
        for line, name, typing_only in imports(path):
            there = stage_of(name)
            if there is None or there == here or (here, there) in USES:
                continue
            where = f"{path.relative_to(SRC.parent)}:{line}"
            if here is not None:
                found.append(f"{where}: stage {here!r} imports stage module {name}")
            elif not typing_only:
                found.append(f"{where}: shared module imports stage module {name}")
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the moesub modules it imports, annotation-only imports included. `from m import
    a` is an edge to m.a when that is a module, else to m; the implicit import of a module's
    parent packages is not an edge (a package's __init__ importing its own modules is fine)."""
    modules = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _line, imported, _typing_only in imports(path, members=True):
            if imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles, each once as `[m, ..., m]` (depth-first search; a module on the
    current path reached again closes a cycle)."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :]
            start = cycle.index(min(cycle))  # one rotation per cycle
            found.append([*cycle[start:], *cycle[:start], min(cycle)])
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return sorted({tuple(c): c for c in found}.values())


def test_no_stage_imports_another_stage():
    assert violations() == []


def test_traces_is_shared():
    """Tools outside the repo and later stages both call moesub.traces: it is shared."""
    modules = [module_name(p) for p in sorted((SRC / "traces").rglob("*.py"))]
    assert "moesub.traces.formats" in modules
    assert all(stage_of(m) is None for m in modules)


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_rule_sees_every_import_form(tmp_path, monkeypatch):
    """The checker itself: nested, relative, `from moesub import x` and TYPE_CHECKING imports."""
    pkg = tmp_path / "moesub"
    (pkg / "expb").mkdir(parents=True)
    (pkg / "expb" / "__init__.py").write_text("")
    (pkg / "expb" / "run.py").write_text(
        "def f():\n    from moesub.emulate import x\n"
        "from ..capture import y\nfrom moesub import regime\nfrom .plan import z\n"
    )
    (pkg / "replay.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moesub.embedded import C\n"
    )
    (pkg / "artefacts.py").write_text("import moesub.capture\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    assert sorted(violations()) == [
        "moesub/artefacts.py:1: shared module imports stage module moesub.capture",
        "moesub/expb/run.py:2: stage 'expb' imports stage module moesub.emulate",
        "moesub/expb/run.py:3: stage 'expb' imports stage module moesub.capture",
        "moesub/expb/run.py:4: stage 'expb' imports stage module moesub.regime",
    ]


def test_the_cycle_check_sees_annotation_only_imports(tmp_path, monkeypatch):
    """The checker itself: a cycle through a `TYPE_CHECKING` import and a `from package import
    module` edge, and no cycle from a package importing its own modules."""
    pkg = tmp_path / "moesub"
    (pkg / "stats").mkdir(parents=True)
    (pkg / "stats" / "__init__.py").write_text("from moesub.stats.load import f\n")
    (pkg / "stats" / "load.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moesub.stats import params\n"
    )
    (pkg / "stats" / "params.py").write_text("from moesub.stats.load import number\n")
    (pkg / "corpus.py").write_text("import numpy\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    assert cycles(import_graph()) == [
        ["moesub.stats.load", "moesub.stats.params", "moesub.stats.load"]
    ]


def test_config_parses_without_the_policy_core():
    code = "import moesub.config, sys; assert 'moesub._core' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    heavy = "import moesub.config, sys; assert not {'torch', 'numpy'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", heavy], check=True)
