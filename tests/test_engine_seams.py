"""The engine package's seams, checked on its source: only the KV cache changes block
counts, and what crosses between its parts is typed.

These guard the package's shape (``inference_lab/core/engine/__init__.py`` lists its
modules); the behaviour itself is the other engine tests'.
"""

from __future__ import annotations

import ast
import enum
from pathlib import Path

import attrs
import pytest

from inference_lab.core.engine import RequestStatus, SchedulerOutput
from tests.import_graph import PACKAGE

ENGINE = PACKAGE / "core" / "engine"
#: attributes that are block counts: a request's blocks, the pool's free blocks
BLOCK_COUNTS = {"num_blocks", "free"}
#: the modules that own block counts (the request only sets its initial 0)
OWNERS = {"block_pool.py", "kv_cache_manager.py", "request.py"}


def _writes(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every assignment, augmented or not, to an attribute named in
    BLOCK_COUNTS in the module at ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in BLOCK_COUNTS:
                    out.append((node.lineno, sub.attr))
    return out


def test_only_the_kv_cache_changes_block_counts() -> None:
    """No module of the engine but the block pool and the KV cache manager writes a
    request's ``num_blocks`` or a pool's ``free``: the scheduler asks, it never keeps."""
    offenders = {
        p.name: _writes(p)
        for p in sorted(ENGINE.glob("*.py"))
        if p.name not in OWNERS and _writes(p)
    }
    assert offenders == {}
    assert _writes(ENGINE / "kv_cache_manager.py")  # the walk does see such writes


def test_the_write_finder_finds_a_write(tmp_path: Path) -> None:
    """The check above can fail: a write in a made-up module is found."""
    fake = tmp_path / "seam_probe.py"
    fake.write_text("def f(pool, r):\n    pool.free -= 1\n    r.num_blocks = 3\n")
    assert _writes(fake) == [(2, "free"), (3, "num_blocks")]


def test_the_scheduler_hands_over_typed_values() -> None:
    """A scheduler's output is a frozen attrs value and a request's status an enum."""
    out = SchedulerOutput([], [], [], None, 0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        out.preempted = 1  # type: ignore[misc]
    params = attrs.fields(SchedulerOutput)
    assert {f.name for f in params} == {"batch", "positions", "contexts", "terms", "preempted"}
    assert issubclass(RequestStatus, enum.IntEnum)
    assert [s.name for s in RequestStatus] == [
        "PENDING",
        "WAITING",
        "RUNNING",
        "DONE",
        "RECEIVING",
        "HELD",
    ]
