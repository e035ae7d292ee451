"""The documentation keeps up with the code: the maintainers' guide's test table names
every test module, the links between the pages resolve (files and headings), and
`.gitignore` covers what the example commands write."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INTERNALS = ROOT / "docs" / "internals.md"
PAGES = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md"])


def _test_table() -> str:
    text = INTERNALS.read_text()
    section = text[text.index("## How the tests are organised") :]
    section = section[: section.index("\n## ", 1)]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_internals_test_table_names_every_test_module() -> None:
    """``docs/internals.md`` lists every ``tests/test_*.py`` in its test table, and
    names none that does not exist."""
    named = set(re.findall(r"`(test_\w+\.py)", _test_table()))
    files = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert sorted(files - named) == [], "test modules missing from the table"
    assert sorted(named - files) == [], "the table names test modules that do not exist"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_the_pages_resolve() -> None:
    """Every relative link of the README, the CHANGELOG and ``docs/*.md`` names a file
    that exists and, with a ``#fragment``, a heading of that page."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_the_link_check_sees_a_broken_anchor() -> None:
    """The check above can fail: a heading's anchor is found, another word is not."""
    assert "the-serve-package" in _anchors(INTERNALS)
    assert "no-such-heading" not in _anchors(INTERNALS)


#: The flags with which the CLIs write a file (or, ``plan -o``, a folder).
_OUTPUT_FLAGS = (
    "-o",
    "--output",
    "--out",
    "--csv",
    "--request-csv",
    "--report",
    "--timeseries",
    "--write-sessions",
    "--plot",
)


def _example_outputs() -> set[str]:
    """The relative paths the example commands of the README and docs/ write in the
    checkout: the values of output flags (placeholders in capitals and the docs' own
    pictures left out) and ``plan``'s default folder ``plan-<spec name>/``."""
    found: set[str] = set()
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        blocks = re.findall(r"```[^\n]*\n(.*?)```", page.read_text(), flags=re.S)
        for block in blocks:
            for command in block.replace("\\\n", " ").splitlines():
                if "inference-lab " not in command:
                    continue
                words = command.split()
                for flag, value in zip(words, words[1:], strict=False):
                    if flag in _OUTPUT_FLAGS:
                        found.add(value)
                    elif flag.startswith("kind=") and "path=" in flag:
                        found.add(flag.split("path=", 1)[1])
                plan = re.search(r"inference-lab plan (\S+\.toml)", command)
                if plan is not None and not re.search(r" (-o|--out) ", command):
                    found.add(f"plan-{Path(plan.group(1)).stem}/")
    return {
        path
        for path in found
        if not re.search(r"[A-Z]{3}", path) and not path.startswith(("docs/", "/", "-"))
    }


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether a root-anchored ``.gitignore`` pattern covers ``path`` (a file, or a
    folder when it ends with ``/``) or the folder it is in."""
    from fnmatch import fnmatch

    first = path.split("/", 1)[0]
    for pattern in patterns:
        if not pattern.startswith("/"):
            continue
        body = pattern[1:]
        if body.endswith("/"):
            if fnmatch(first, body[:-1]) and ("/" in path):
                return True
        elif fnmatch(path, body):
            return True
    return False


def test_gitignore_covers_what_the_examples_and_builds_write() -> None:
    """Running the README's and docs' example commands in the checkout, or building the
    package, leaves ``git status`` clean: ``.gitignore`` names every output."""
    patterns = [
        line.strip()
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    outputs = _example_outputs()
    assert {"result.json", "report.html", "sessions.jsonl"} <= outputs  # the scan finds them
    missing = sorted(p for p in outputs | {"build/x", "dist/x"} if not _ignored(p, patterns))
    assert missing == [], f".gitignore misses {missing}"


def test_the_readme_stays_short_and_names_both_test_lanes() -> None:
    """The README is at most 250 lines, and tells a newcomer how to choose the port and
    about the quick test lane beside the full one."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make test-fast" in text and "make test " in text
    assert "--port" in text and "PORT=" in text


def test_make_serve_passes_the_port_and_other_flags() -> None:
    """``make serve PORT=9000 ARGS='--max-num-seqs 16'`` runs ``inference-lab serve --port
    9000 --max-num-seqs 16`` (make's dry run, outside any other make; skipped without
    make)."""
    import os
    import shutil
    import subprocess

    if shutil.which("make") is None:
        import pytest

        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}

    def recipe(*argv: str) -> str:
        proc = subprocess.run(
            ["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "serve", *argv],
            cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (line,) = [x for x in proc.stdout.splitlines() if "inference-lab serve" in x]
        return line

    assert recipe("PORT=9000", "ARGS=--max-num-seqs 16") == (
        ".venv/bin/inference-lab serve --port 9000 --max-num-seqs 16"
    )
    assert recipe() == ".venv/bin/inference-lab serve --port 8080 "


def test_every_test_marked_slow_exists() -> None:
    """``tests/slow.py`` names only test modules and test functions that exist, so a
    renamed slow test cannot fall into ``make test-fast`` unnoticed."""
    import ast

    from tests.slow import SLOW_MODULES, SLOW_TESTS

    tests = ROOT / "tests"
    missing = [m for m in SLOW_MODULES | set(SLOW_TESTS) if not (tests / m).is_file()]
    for module, names in SLOW_TESTS.items():
        path = tests / module
        if not path.is_file():
            continue
        defined = {
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        missing += [f"{module}::{n}" for n in sorted(names - defined)]
    assert missing == []
