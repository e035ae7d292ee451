"""The documentation keeps up with the code: the maintainers' guide's test table names
every test module, and the links between the pages resolve (files and headings)."""

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
