"""The package's import graph, read from the source (nothing is imported).

Used by the layering tests: the pure core, the transport fence, no circles, the load
client's independence. Every ``import`` counts, wherever it stands (a function's lazy
import and a ``TYPE_CHECKING`` import are dependencies too).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "inference_lab"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What ``name`` imports: package modules resolved to the module (``from pkg import
    mod`` is ``pkg.mod`` when that is a module), anything else by its full dotted name."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> every name it imports (package modules and third-party alike)."""
    known = modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def internal(graph_: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph restricted to the package's own modules."""
    return {m: {d for d in deps if d in graph_ and d != m} for m, deps in graph_.items()}


def reachable(graph_: dict[str, set[str]], start: str) -> set[str]:
    """The package modules ``start`` reaches, itself included."""
    own = internal(graph_)
    seen = {start}
    todo = [start]
    while todo:
        for dep in own[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def cycles(graph_: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted.
    A package's ``__init__`` re-exporting its own submodules is not counted: the edge
    from a submodule to its parent package is dropped."""
    own = internal(graph_)
    for m, deps in own.items():
        own[m] = {d for d in deps if not m.startswith(d + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in own[v]:
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
                out.append(sorted(comp))

    for v in sorted(own):
        if v not in index:
            visit(v)
    return out
