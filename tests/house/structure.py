"""The house's counts, read from the source: private reaches, import circles, loose modules.

Used by tests/house/test_structure.py (the limits) and printable as JSON for a closing note:
``python -m tests.house.structure``.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "elastic"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = RUNTIME) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def _imports(path: Path, name: str, known: dict[str, Path]) -> Iterator[str]:
    """Every elastic module ``path`` imports, anywhere in it (TYPE_CHECKING and function
    bodies included: a circle held open by either is still a circle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([base] if base else []))
            # ``from pkg import sub`` names the submodule, not the package's own code
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            yield from subs
            if len(subs) < len(node.names):
                yield base


def import_graph(root: Path = RUNTIME) -> dict[str, set[str]]:
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph[name] = {t for t in _imports(path, name, known) if t in known and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def package_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles between the runtime's packages (elastic.worker -> elastic.node -> ...)."""

    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or m in _PACKAGES else "elastic"

    _PACKAGES.update(m for m, p in modules().items() if p.name == "__init__.py")
    pg: dict[str, set[str]] = {}
    for m, targets in graph.items():
        pg.setdefault(package(m), set()).update(package(t) for t in targets)
    for k in pg:
        pg[k].discard(k)
        pg[k] &= set(pg)
    return circles(pg)


_PACKAGES: set[str] = set()


def private_reaches(root: Path) -> list[str]:
    """``x._name`` where ``x`` is neither ``self`` nor ``cls`` nor an imported module: one
    object reaching into another's private state (a module's own private globals, and
    torch's private functions reached through a module, are not counted)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {"self", "cls"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                aliases.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id not in aliases
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def loose_modules() -> list[str]:
    return sorted(p.name for p in RUNTIME.glob("*.py") if p.name != "__init__.py")


def lines(root: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in root.rglob("*.py"))


def summary() -> dict[str, object]:
    graph = import_graph()
    return {
        "runtime_lines": lines(RUNTIME),
        "tools_lines": lines(REPO / "elastic_tools") if (REPO / "elastic_tools").exists() else 0,
        "worker_private_reaches": len(private_reaches(RUNTIME / "worker")),
        "module_circles": circles(graph),
        "package_circles": package_circles(graph),
        "loose_modules": loose_modules(),
    }


if __name__ == "__main__":
    print(json.dumps(summary(), indent=1))
