"""``inference-lab sim``: flags, the configuration print, the progress bar, the output files.

``cli.py`` calls :func:`add_parser` and then :func:`run`. The simulation itself is
:func:`inference_lab.sim.run.run_simulation`.

Rule 1: this module's top level imports only the standard library and the flag toolkit, so
        parsing (``--help``, a bad flag) costs no numpy; ``run`` imports the engine.
Rule 2: bad input (missing file, unknown shipped name, bad key, unknown or ambiguous
        hardware entry, unwritable output, a workload that cannot run) is one line on stderr,
        ``inference-lab sim: error: <message>``, and exit code 1; a bad flag value is
        argparse's one line and exit code 2 (``cli.py`` states the policy).
Rule 3: output files are checked before the run and written after it: a long simulation is
        not lost to a typo in ``-o``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import EXIT_OK, check_output, fail, integer

if TYPE_CHECKING:
    from inference_lab.sim.run import Progress

__all__ = ["add_parser", "run"]

PROG = "inference-lab sim"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``sim`` and its flags on the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        description="Run a workload through the simulated engine as fast as the CPU allows and "
        "report TTFT / TPOT / E2E / queue-time percentiles, throughput and utilisation.",
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="PATH|NAME",
        help="model config TOML, or the name of a shipped one (gpt-oss-20b)",
    )
    parser.add_argument(
        "--hardware",
        metavar="NAME",
        help="the config's [hardware.NAME] entry (may be omitted when there is only one)",
    )
    parser.add_argument(
        "--workload",
        required=True,
        metavar="PATH|NAME",
        help="workload TOML, or the name of a shipped one (chat-closed-64)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=integer(ge=1),
        metavar="N",
        help="cap on running requests per worker; overrides [scheduler] max_num_seqs",
    )
    parser.add_argument(
        "--max-waiting",
        type=integer(ge=0),
        metavar="N",
        help="waiting-queue bound (0 = unbounded; arrivals beyond it are refused); "
        "overrides [scheduler] max_waiting",
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="PATH", help="write the summary as JSON"
    )
    parser.add_argument(
        "--request-csv", type=Path, metavar="PATH", help="write one CSV row per request"
    )
    parser.add_argument(
        "--seed", type=integer(ge=0), metavar="N", help="override the workload's seed"
    )
    parser.add_argument(
        "--profiles-dir",
        metavar="DIR",
        type=Path,
        help="hardware profile directory (default: hardware_profiles/ next to the configs)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no configuration print, no progress bar"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )
    return parser


def _os_error_message(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _progress_bar(total: int | None) -> tuple[Callable[[Progress], None], Callable[[], None]]:
    from tqdm import tqdm

    bar = tqdm(
        total=total, unit="req", desc="sim", file=sys.stderr, disable=None, dynamic_ncols=True
    )

    def update(p: Progress) -> None:
        done = p.done + p.refused
        if done > bar.n:
            bar.update(done - bar.n)
        bar.set_postfix_str(
            f"t={p.time:,.1f}s run={p.running} wait={p.waiting} kv={p.kv_usage:.0%}", refresh=False
        )

    return update, bar.close


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``sim`` command; returns the exit code (Rule 2)."""
    from inference_lab.core.config import load_deployment, load_workload, override_scheduler
    from inference_lab.errors import InferenceLabError
    from inference_lab.resources import resolve_shipped
    from inference_lab.sim.run import (
        config_dict,
        format_config,
        format_summary,
        run_simulation,
        write_request_csv,
    )

    try:
        check_output("-o", args.output)
        check_output("--request-csv", args.request_csv)
    except ValueError as exc:
        return fail(PROG, str(exc))
    try:
        config_path = resolve_shipped(args.config, "config", "--config")
        workload_path = resolve_shipped(args.workload, "workload", "--workload")
        deployment = override_scheduler(
            load_deployment(config_path, args.hardware, args.profiles_dir),
            max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting,
        )
        workload = load_workload(workload_path)
        seed = workload.seed if args.seed is None else args.seed
        if not args.quiet:
            print(format_config(deployment, workload, str(workload_path), seed), flush=True)
        progress: Callable[[Progress], None] | None = None
        close: Callable[[], None] = lambda: None  # noqa: E731
        if not (args.quiet or args.no_progress):
            progress, close = _progress_bar(workload.num_requests)
        try:
            result = run_simulation(deployment, workload, seed=args.seed, progress=progress)
        finally:
            close()
        if not args.quiet:
            print()
        print(format_summary(result))
        if args.output is not None:
            doc = {
                "config": config_dict(deployment, workload, str(workload_path), seed),
                **result.to_dict(),
            }
            with open(args.output, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
                fh.write("\n")
        if args.request_csv is not None:
            with open(args.request_csv, "w", encoding="utf-8", newline="") as fh:
                write_request_csv(result, fh)
    except InferenceLabError as exc:
        return fail(PROG, str(exc))
    except OSError as exc:
        return fail(PROG, _os_error_message(exc))
    return EXIT_OK
