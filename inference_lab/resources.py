"""Where the shipped data lives: the model configs (``configs/``, with ``configs/workloads/``)
and the hardware profiles (``hardware_profiles/``).

Rule 1: in a checkout they are the repository's top-level ``configs/`` and
        ``hardware_profiles/``; a built wheel carries the same files as package data,
        ``inference_lab/configs/`` and ``inference_lab/hardware_profiles/`` (the mapping is
        ``[tool.setuptools.package-dir]`` in ``pyproject.toml``).
Rule 2: the answer depends only on where this package is, never on the working directory,
        so ``inference-lab serve`` finds the shipped models from any directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = ["ShippedData", "shipped_dir"]

ShippedData = Literal["configs", "hardware_profiles"]

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(name: ShippedData) -> Path:
    """The directory of the shipped ``configs`` or ``hardware_profiles``: the installed
    package's copy if there is one, else the checkout's top-level directory (Rule 1).

    When neither exists (a broken install) it returns the installed location anyway, so the
    loader's "no such file" error names where the files were expected. Called by the config
    loader (default hardware profiles) and by ``serve`` (default ``--config``)."""
    installed = _PACKAGE / name
    if installed.is_dir():
        return installed
    checkout = _PACKAGE.parent / name
    return checkout if checkout.is_dir() else installed
