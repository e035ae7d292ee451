"""The package's size rules: every module at most :data:`MAX_MODULE_LINES` lines and every
function (methods and nested functions included) at most :data:`MAX_FUNCTION_LINES`,
from its ``def`` line to its last line (docs/internals.md, "Size and complexity").
Ruff's complexity checks (``C901``, ``PLR0912``, ``PLR0915`` in pyproject.toml) run with
``make lint``; these two rules have no ruff check, so they are walked here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "inference_lab"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def oversized(source: str, where: str) -> list[str]:
    """What in ``source`` (the text of the module ``where``) passes a size rule."""
    found = []
    lines = source.count("\n")
    if lines > MAX_MODULE_LINES:
        found.append(f"{where}: {lines} lines (module limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{where}:{node.lineno} {node.name}: {length} lines "
                    f"(function limit {MAX_FUNCTION_LINES})"
                )
    return found


def test_every_module_and_function_is_within_its_size() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 100  # the package was walked
    found = [x for path in modules for x in oversized(path.read_text(), str(path))]
    assert found == []


def test_the_walk_finds_a_long_function_and_a_long_module() -> None:
    """The check can fail: a made-up module with an 81-line method and 601 lines."""
    body = "".join(f"        x = {i}\n" for i in range(80))
    source = "class A:\n    def f(self) -> None:\n" + body
    assert oversized(source, "m.py") == ["m.py:2 f: 81 lines (function limit 80)"]
    assert oversized("x = 1\n" * 601, "m.py") == ["m.py: 601 lines (module limit 600)"]
    assert oversized("def f() -> None:\n" + "    pass\n" * 79, "m.py") == []
