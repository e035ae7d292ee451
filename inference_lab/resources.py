"""Where the shipped data lives: the model configs (``configs/``, with ``configs/frontier/``,
``configs/fidelity/``, ``configs/workloads/`` and ``configs/plans/``) and the hardware
profiles (``hardware_profiles/``); how a name given on a command line finds one of them;
the installed version.

Rule 1: in a checkout they are the repository's top-level ``configs/`` and
        ``hardware_profiles/``; a built wheel carries the same files as package data,
        ``inference_lab/configs/`` and ``inference_lab/hardware_profiles/`` (the mapping is
        ``[tool.setuptools.package-dir]`` in ``pyproject.toml``).
Rule 2: the answer depends only on where this package is, never on the working directory,
        so ``inference-lab serve`` finds the shipped models from any directory.
Rule 3: a path that exists always wins over a name: ``--config gpt-oss-20b`` means the
        shipped ``gpt-oss-20b.toml`` only when the working directory has no file of that
        name. A kind's names are the stems of its folders' files (:data:`SHIPPED`): a
        model config is any of ``configs/``, ``configs/frontier/`` and
        ``configs/fidelity/`` (``DeepSeek-V3``), a trace any ``.jsonl`` / ``.csv`` of
        ``configs/workloads/`` (``mooncake-sample``), a plan any of ``configs/plans/``
        (``chat-20rps``); no two of a kind share a name (a test checks).
Rule 4: an unknown name is one line that names the closest shipped names (``did you
        mean``) and lists them all.
Rule 5: one rule for a deployment's hardware entry in every command (``sim``, ``serve``,
        ``calibrate``): ``--hardware NAME`` names it; without the flag, a config's only
        entry, else its :data:`DEFAULT_HARDWARE` entry, else an error listing the entries
        (:func:`default_hardware`).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from inference_lab.errors import ConfigError

__all__ = [
    "DEFAULT_HARDWARE",
    "ShippedData",
    "ShippedKind",
    "package_version",
    "SHIPPED",
    "default_hardware",
    "did_you_mean",
    "resolve_shipped",
    "shipped_dir",
    "shipped_files",
    "shipped_names",
]

ShippedData = Literal["configs", "hardware_profiles"]
#: What a command-line name can stand for: a model config, a workload, a trace or a plan.
ShippedKind = Literal["config", "workload", "trace", "plan"]

_PACKAGE = Path(__file__).resolve().parent
_WHAT: dict[ShippedKind, str] = {
    "config": "model config",
    "workload": "workload",
    "trace": "trace",
    "plan": "plan spec",
}
#: Rule 3: each kind's folders under ``configs/`` (searched in this order) and suffixes.
SHIPPED: dict[ShippedKind, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "config": (("", "frontier", "fidelity"), (".toml",)),
    "workload": (("workloads",), (".toml",)),
    "trace": (("workloads",), (".jsonl", ".csv")),
    "plan": (("plans",), (".toml",)),
}


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


def shipped_files(kind: ShippedKind) -> dict[str, Path]:
    """The shipped files of ``kind`` by name (file stem), in their folders' order and
    sorted within each (Rule 3)."""
    folders, suffixes = SHIPPED[kind]
    configs = shipped_dir("configs")
    out: dict[str, Path] = {}
    for folder in folders:
        base = configs / folder if folder else configs
        found = (p for p in base.glob("*") if p.suffix in suffixes and p.is_file())
        for path in sorted(found, key=lambda p: p.name):
            out.setdefault(path.stem, path)
    return out


def shipped_names(kind: ShippedKind) -> list[str]:
    """The names of the shipped files of ``kind`` (file stems), sorted."""
    return sorted(shipped_files(kind))


def did_you_mean(name: str, names: list[str]) -> list[str]:
    """The names closest to ``name`` (a case-insensitive match first, then ``difflib``'s
    closest, at most three), for an error's ``did you mean`` (Rule 4)."""
    lowered = {n.lower(): n for n in names}
    exact = lowered.get(name.lower())
    close = difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)
    out = [exact] if exact is not None else []
    out += [lowered[c] for c in close if lowered[c] not in out]
    return out[:3]


def resolve_shipped(text: str | os.PathLike[str], kind: ShippedKind, label: str) -> Path:
    """What ``--config`` / ``--workload`` / ``--trace`` / ``plan SPEC`` (or an
    ``INFERENCE_LAB_*`` variable, named by ``label`` in the error) means (Rule 3):
    ``text`` itself when that path exists; else, for a bare name (no directory part, the
    suffix optional), the shipped file of that name; else ConfigError, one line with the
    closest names and every shipped name (Rule 4). A missing path with a directory part
    is returned as is, so the loader's "no such file" names it.

    Called by ``sim``, ``plan``, ``calibrate`` and the serve settings (flags and
    environment)."""
    path = Path(text)
    if path.exists() or len(path.parts) != 1:
        return path
    files = shipped_files(kind)
    name = path.name
    for suffix in SHIPPED[kind][1]:
        name = name.removesuffix(suffix)
    if name in files:
        return files[name]
    names = sorted(files)
    what = _WHAT[kind]
    close = did_you_mean(name, names)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    listed = ", ".join(names) or "none found"
    raise ConfigError(
        f"{label} {text}: no such file, and no shipped {what} of that name{hint} "
        f"(shipped {what}s: {listed})"
    )


#: The hardware entry a command deploys when ``--hardware`` is not given and a config has
#: several (Rule 5).
DEFAULT_HARDWARE = "b200"


def default_hardware(entries: Collection[str]) -> str | None:
    """Rule 5: the entry to deploy among a config's ``entries`` when ``--hardware`` is not
    given: the only one, else :data:`DEFAULT_HARDWARE` if present, else None (the caller
    asks for ``--hardware``). Called by ``sim``, ``calibrate`` and the serve settings."""
    names = list(entries)
    if len(names) == 1:
        return names[0]
    return DEFAULT_HARDWARE if DEFAULT_HARDWARE in names else None


def package_version() -> str:
    """The installed distribution's version (``inference-lab --version``, ``GET /version``),
    or ``unknown`` for a tree that was never installed."""
    try:
        return importlib.metadata.version("inference-lab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
