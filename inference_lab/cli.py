"""The ``inference-lab`` command: ``sim``, ``serve``, ``load``, ``plan``, ``calibrate`` and
``proxy``.

Each subcommand is one module exposing ``add_parser(subparsers)`` (its flags) and
``run(args) -> int`` (the work); this module only picks the subcommand and dispatches.

Rule 1: only the chosen subcommand's module is imported, and that module imports its
        machinery inside ``run``: ``inference-lab sim`` never loads trio, quart or
        hypercorn, and ``--help`` or a bad flag answers before numpy is loaded (for ``sim``,
        ``load`` and ``calibrate``; ``serve``'s module imports its stack at the top).
Rule 2: one exit-code policy for every subcommand, each error one line on stderr,
        ``inference-lab <sub>: error: <message>``, never a traceback:

        - 0: done (``load``: the run completed and at least one request succeeded;
          ``serve``: stopped by SIGINT / SIGTERM, its normal end).
        - 1: the command line was well formed but the run could not proceed: a file
          missing, unreadable or invalid, an unknown shipped name, an output directory
          that does not exist, an unknown or ambiguous hardware entry, a server that
          cannot be reached or does not serve the model, a ``load`` run in which every
          request failed, a port in use, a workload that cannot run, ``--plot`` without
          matplotlib.
        - 2: the command line is wrong: an unknown or missing flag, a value of the wrong
          type or out of range (``sim --seed -1``), flags that cannot go together.
        - 130: interrupted by Ctrl-C (``load`` still prints and writes its partial report).

        A bare ``inference-lab`` (no arguments at all) prints the whole help on stderr and
        exits 2: the command line lacks its subcommand, but a newcomer gets the list of
        subcommands rather than argparse's one line.

        The constants and the one-line helpers are in :mod:`inference_lab.cli_args`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from inference_lab.cli_args import EXIT_INTERRUPTED, EXIT_USAGE, CliParser
from inference_lab.resources import package_version

__all__ = ["SUBCOMMANDS", "main"]

#: name -> (the module with ``add_parser`` and ``run``, the one-line summary for ``--help``)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sim": (
        "inference_lab.sim.cli",
        "simulate a workload offline and report latency / throughput",
    ),
    "serve": (
        "inference_lab.serve.cli",
        "serve the OpenAI HTTP API over simulated, roofline-paced engines",
    ),
    "load": (
        "inference_lab.client.cli",
        "drive a server with closed-loop, open-loop or adaptive (AIMD) load",
    ),
    "plan": (
        "inference_lab.plan.cli",
        "find the cheapest deployment that serves a workload within its SLOs",
    ),
    "calibrate": (
        "inference_lab.calibrate.cli",
        "fit a deployment's efficiency terms to measurements of a real server",
    ),
    "proxy": (
        "inference_lab.proxy.cli",
        "a prefill/decode proxy in front of serve --role prefill and --role decode servers",
    ),
}


def build_parser(command: str | None) -> tuple[CliParser, CliParser | None]:
    """The top-level parser and ``command``'s parser (None when no subcommand was named).
    Only ``command``'s flags are defined (its module imported, Rule 1); the other
    subcommands are bare entries, enough for the ``--help`` listing and for argparse to
    name the choices."""
    parser = CliParser(
        prog="inference-lab",
        description="A simulated OpenAI-compatible LLM inference server and its tools.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"inference-lab {package_version()}",
        help="print the installed version and exit",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}"
    )
    chosen: CliParser | None = None
    for name, (module, summary) in SUBCOMMANDS.items():
        if name == command:
            chosen = importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser, chosen


def _chosen(argv: Sequence[str]) -> str | None:
    # The top-level parser has no option that takes a value (``--version`` and ``--help``
    # take none), so its first positional argument is the subcommand.
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in SUBCOMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit code
    (Rule 2). The console script ``inference-lab``, ``python -m inference_lab`` and
    ``python -m inference_lab.cli`` call it."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser, chosen = build_parser(_chosen(args_list))
    if not args_list:  # Rule 2: the help, not one line, for a bare command
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        args, unknown = parser.parse_known_args(args_list)
        if unknown:  # reported by the subcommand, so the line names it
            (chosen or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        code: int = module.run(args)
    except KeyboardInterrupt:
        print(f"inference-lab {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
