"""Edge validation for command-line arguments: the one toolkit every ``inference-lab``
subcommand parses its flags with, and the helpers of the exit-code policy in ``cli.py``.

Rule 1: a flag's value is checked where argparse reads it, by a ``type=`` built here
        (:func:`integer`, :func:`number`); a bad value is a usage error, exit 2, before any
        file is read or any work starts.
Rule 2: every error is one line, ``inference-lab <sub>: error: <message>``: argparse's own
        complaints (through :class:`CliParser`) and the run-time ones (through :func:`fail`).
Rule 3: the wording is shared with the environment-variable settings of a plain hypercorn
        launch: :func:`parse_int` raises ``ValueError("must be an integer >= 0, got -1")``,
        the tail the caller prefixes with the flag or variable name.

This module imports nothing beyond the standard library, so building a parser stays cheap
(``inference-lab sim`` must not pay for the serve stack).
"""

from __future__ import annotations

import argparse
import math
import operator
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliParser",
    "check_output",
    "fail",
    "integer",
    "number",
    "parse_int",
]

#: The command did what it was asked (``load``: a run in which some request succeeded).
EXIT_OK = 0
#: The command line was well formed but the run could not proceed: a file missing,
#: unreadable or invalid, an output directory that does not exist, a server that cannot be
#: reached or does not serve the model, a ``load`` run in which every request failed, a
#: port in use, a workload that cannot run, a missing optional dependency.
EXIT_ERROR = 1
#: The command line itself is wrong: an unknown flag, a missing one, a value of the wrong
#: type or out of range, flags that cannot go together.
EXIT_USAGE = 2
#: Interrupted by Ctrl-C (SIGINT) before the work was done.
EXIT_INTERRUPTED = 130


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line and exit 2 (Rule 2).

    ``cli.py`` builds the top-level parser with it; argparse makes each subcommand's parser
    of the same class, so ``add_parser`` functions get it without asking.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str, code: int = EXIT_ERROR) -> int:
    """Print ``<prog>: error: <message>`` (its first line only) on stderr; return ``code``.

    Called by the subcommands' ``run`` for every error found after parsing: ``EXIT_ERROR``
    by default, ``EXIT_USAGE`` for flag combinations argparse cannot express."""
    lines = message.strip().splitlines()
    print(f"{prog}: error: {lines[0] if lines else 'failed'}", file=sys.stderr)
    return code


def _bounds_text(ge: float | None, le: float | None) -> str:
    if ge is not None and le is not None:
        return f"in {ge}..{le}"
    if ge is not None:
        return f">= {ge}"
    if le is not None:
        return f"<= {le}"
    return ""


def parse_int(text: str, *, ge: int | None = None, le: int | None = None) -> int:
    """``text`` as an integer within ``[ge, le]`` (either bound optional).

    Raises ``ValueError`` whose message is the tail of a one-line error (Rule 3), e.g.
    ``must be an integer >= 0, got '-x'``. Used by :func:`integer` for flags, and meant for
    the ``INFERENCE_LAB_*`` integer variables of a plain hypercorn launch.
    """
    what = " ".join(filter(None, ("must be an integer", _bounds_text(ge, le))))
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what}, got {text!r}") from None
    if (ge is not None and value < ge) or (le is not None and value > le):
        raise ValueError(f"{what}, got {value}")
    return value


def integer(*, ge: int | None = None, le: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``[ge, le]``; otherwise a usage error naming the
    flag (``argument --seed: must be an integer >= 0, got -1``)."""

    def parse(text: str) -> int:
        try:
            return parse_int(text, ge=ge, le=le)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def number(
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Callable[[str], float]:
    """An argparse ``type=``: a finite float within the given bounds (``gt``/``lt`` strict,
    ``ge``/``le`` inclusive); NaN and infinities are refused."""
    bounds = (
        (gt, operator.gt, ">"),
        (ge, operator.ge, ">="),
        (lt, operator.lt, "<"),
        (le, operator.le, "<="),
    )
    active = [(b, op, f"{sym} {b:g}") for b, op, sym in bounds if b is not None]
    what = "must be a number"
    if active:
        what += " " + " and ".join(text for _, _, text in active)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
        if not math.isfinite(value) or not all(ok(value, b) for b, ok, _ in active):
            raise argparse.ArgumentTypeError(f"{what}, got {text}")
        return value

    return parse


def check_output(flag: str, path: Path | None) -> None:
    """Refuse an output file that cannot be created: ``ValueError`` (one line naming the
    flag) if ``path`` is a directory or its directory does not exist; None passes.

    Subcommands call it before the run starts, so a long run is not lost to a typo in
    ``-o``; they report the error with :func:`fail` (``EXIT_ERROR``: the flag is well
    formed, the file system disagrees)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")


_PD = re.compile(r"([0-9]+)P([0-9]+)D", re.IGNORECASE)


def pd_split(text: str) -> tuple[int, int]:
    """``--pd``'s value: ``xPyD`` (``2P1D``) as (prefill replicas, decode replicas), each
    1 to 1024; argparse reports a ValueError's message as the flag's error."""
    match = _PD.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected xPyD (e.g. 2P1D), got {text!r}")
    x, y = int(match.group(1)), int(match.group(2))
    if not (1 <= x <= 1024 and 1 <= y <= 1024):
        raise argparse.ArgumentTypeError(f"each pool needs 1 to 1024 replicas, got {text!r}")
    return x, y
