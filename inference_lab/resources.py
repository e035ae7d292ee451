"""Where the shipped data lives: the model configs (``configs/``, with ``configs/workloads/``)
and the hardware profiles (``hardware_profiles/``); how a name given on a command line finds
one of them; the installed version.

Rule 1: in a checkout they are the repository's top-level ``configs/`` and
        ``hardware_profiles/``; a built wheel carries the same files as package data,
        ``inference_lab/configs/`` and ``inference_lab/hardware_profiles/`` (the mapping is
        ``[tool.setuptools.package-dir]`` in ``pyproject.toml``).
Rule 2: the answer depends only on where this package is, never on the working directory,
        so ``inference-lab serve`` finds the shipped models from any directory.
Rule 3: a path that exists always wins over a name: ``--config gpt-oss-20b`` means the
        shipped ``gpt-oss-20b.toml`` only when the working directory has no file of that
        name; an unknown name is one line that lists the shipped names.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Literal

from inference_lab.errors import ConfigError

__all__ = [
    "ShippedData",
    "ShippedKind",
    "package_version",
    "resolve_shipped",
    "shipped_dir",
    "shipped_names",
]

ShippedData = Literal["configs", "hardware_profiles"]
#: What a command-line name can stand for: a model config or a workload.
ShippedKind = Literal["config", "workload"]

_PACKAGE = Path(__file__).resolve().parent
_WHAT: dict[ShippedKind, str] = {"config": "model config", "workload": "workload"}


def shipped_dir(name: ShippedData) -> Path:
    """The directory of the shipped ``configs`` or ``hardware_profiles``: the installed
    package's copy if there is one, else the checkout's top-level directory (Rule 1).

    When neither exists (a broken install) it returns the installed location anyway, so the
    loader's "no such file" error names where the files were expected. Called by the config
    loader (default hardware profiles), by ``serve`` (default ``--config``) and by
    :func:`resolve_shipped`."""
    installed = _PACKAGE / name
    if installed.is_dir():
        return installed
    checkout = _PACKAGE.parent / name
    return checkout if checkout.is_dir() else installed


def _kind_dir(kind: ShippedKind) -> Path:
    configs = shipped_dir("configs")
    return configs if kind == "config" else configs / "workloads"


def shipped_names(kind: ShippedKind) -> list[str]:
    """The names of the shipped model configs or workloads (file stems), sorted."""
    folder = _kind_dir(kind)
    return sorted(p.stem for p in folder.glob("*.toml") if p.is_file())


def resolve_shipped(text: str | os.PathLike[str], kind: ShippedKind, label: str) -> Path:
    """What ``--config`` / ``--workload`` (or its ``INFERENCE_LAB_*`` variable, named by
    ``label`` in the error) means (Rule 3): ``text`` itself when that path exists; else,
    for a bare name (no directory part, ``.toml`` optional), the shipped file of that
    name; else ConfigError, one line listing the shipped names. A missing path with a
    directory part is returned as is, so the loader's "no such file" names it.

    Called by ``sim`` and by the serve settings (flags and environment)."""
    path = Path(text)
    if path.exists() or len(path.parts) != 1:
        return path
    name = path.name.removesuffix(".toml")
    candidate = _kind_dir(kind) / f"{name}.toml"
    if name and candidate.is_file():
        return candidate
    names = ", ".join(shipped_names(kind)) or "none found"
    what = _WHAT[kind]
    raise ConfigError(
        f"{label} {text}: no such file, and no shipped {what} of that name "
        f"(shipped {what}s: {names})"
    )


def package_version() -> str:
    """The installed distribution's version (``inference-lab --version``, ``GET /version``),
    or ``unknown`` for a tree that was never installed."""
    try:
        return importlib.metadata.version("inference-lab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
