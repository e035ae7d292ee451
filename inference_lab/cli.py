"""The ``inference-lab`` command: ``sim``, ``serve`` and ``load`` subcommands.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and
``run(args) -> int``; this module only dispatches. Bad input exits 1 (or argparse's 2) with
a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "sim": "inference_lab.sim",
    "serve": "inference_lab.serve_cli",
    "load": "inference_lab.client.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-lab",
        description="A simulated OpenAI-compatible LLM inference server and its tools.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{sim,serve,load}")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        code: int = module.run(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
