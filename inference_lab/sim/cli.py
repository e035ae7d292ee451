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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import EXIT_OK, check_output, fail, integer, number, pd_split

if TYPE_CHECKING:
    from inference_lab.core.config import Deployment, Workload
    from inference_lab.sim.run import Progress, SimResult
    from inference_lab.traffic.traces import Trace

__all__ = ["add_parser", "run"]

PROG = "inference-lab sim"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``sim`` and its flags on the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        description="Run a workload through the simulated engine as fast as the CPU allows and "
        "report TTFT / TPOT / E2E / queue-time percentiles, throughput and utilisation.",
    )
    _add_deployment_flags(parser)
    _add_source_flags(parser)
    _add_scheduler_flags(parser)
    _add_fleet_flags(parser)
    _add_output_flags(parser)
    _add_run_flags(parser)
    return parser


def _add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    """What is simulated: the model config, its hardware entry, a prefill/decode split."""
    parser.add_argument(
        "--config",
        required=True,
        metavar="PATH|NAME",
        help="model config TOML, or the name of a shipped one (gpt-oss-20b)",
    )
    parser.add_argument(
        "--hardware",
        metavar="NAME",
        help="the config's [hardware.NAME] entry (default: the config's only entry, else b200)",
    )
    parser.add_argument(
        "--pd",
        type=pd_split,
        metavar="xPyD",
        help="prefill/decode disaggregation: x prefill and y decode replicas of the entry "
        "(docs/disaggregation.md); a config's [disaggregation] table does the same",
    )


def _add_source_flags(parser: argparse.ArgumentParser) -> None:
    """Where the requests come from: a workload, or a trace and how it is read."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--workload",
        metavar="PATH|NAME",
        help="workload TOML, or the name of a shipped one (chat-closed-64)",
    )
    source.add_argument(
        "--trace",
        metavar="PATH|NAME",
        help="replay a trace file (mooncake / openai_batch JSONL, azure / burstgpt CSV), or "
        "the name of a shipped one (mooncake-sample)",
    )
    parser.add_argument(
        "--trace-format",
        choices=("mooncake", "azure", "burstgpt", "openai_batch"),
        help="the trace's format (default: told from its first line)",
    )
    parser.add_argument(
        "--speedup",
        type=number(gt=0),
        default=1.0,
        metavar="X",
        help="replay the trace X times faster (default 1)",
    )
    parser.add_argument(
        "--trace-window",
        "--window",  # the older spelling; load's --window is the AIMD window
        dest="window",
        type=_window,
        metavar="START:END",
        help="replay only the trace's requests from START to END seconds (END may be empty; "
        "as load --trace-window)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="openai_batch: tokenize prompts with this tokenizer (default: the model "
        "config's tokenizer, else the byte rule)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=integer(ge=1),
        metavar="N",
        help="openai_batch: output tokens of a body without max_tokens",
    )


def _add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    """The scheduler's limits that override the config's ``[scheduler]``."""
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


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """The files a run writes: summary, rows, report, time series, sessions."""
    parser.add_argument(
        "-o", "--output", type=Path, metavar="PATH", help="write the summary as JSON"
    )
    parser.add_argument(
        "--request-csv", type=Path, metavar="PATH", help="write one CSV row per request"
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="PATH",
        help="write a self-contained HTML report: configuration, summary, time series, "
        "latency distributions (opens offline)",
    )
    parser.add_argument(
        "--timeseries",
        type=Path,
        metavar="PATH",
        help="write the sampled time series as CSV (one row per --series-interval)",
    )
    parser.add_argument(
        "--series-interval",
        type=number(gt=0),
        metavar="SECONDS",
        help="simulated seconds per point of --report's and --timeseries' series (default 0.5)",
    )
    parser.add_argument(
        "--write-sessions",
        type=Path,
        metavar="PATH",
        help="a session workload: write its sessions (starts, turns, think times) as JSONL "
        "for `inference-lab load --sessions`",
    )


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The seed, where the hardware profiles are, and what the run prints as it goes."""
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


def _add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    """``--replicas``, ``--ray`` and ``--shards`` (docs/sim.md#a-fleet-on-ray)."""
    parser.add_argument(
        "--replicas",
        type=integer(ge=1),
        metavar="N",
        help="replicas of the deployment; overrides the hardware entry's replicas",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="shard the replicas across Ray workers and merge their summaries: 'local' "
        "(the default: a private instance), 'auto' (this machine's cluster) or an address",
    )
    parser.add_argument(
        "--shards",
        type=integer(ge=1),
        metavar="K",
        help="--ray: jobs to split the replicas into (default: the cluster's CPUs, at most "
        "one per replica)",
    )


def _fleet_flags_conflict(args: argparse.Namespace) -> str | None:
    """Why the flags cannot go with ``--ray`` (or ``--shards`` without it), or None."""
    if args.pd is not None and args.replicas is not None:
        return "--replicas does not go with --pd: xPyD names each pool's replicas"
    if args.ray is None:
        return "--shards applies to --ray only" if args.shards is not None else None
    for flag, value in (
        ("--request-csv", args.request_csv),
        ("--report", args.report),
        ("--timeseries", args.timeseries),
    ):
        if value is not None:
            return f"{flag} needs every request's record, which a sharded run does not keep"
    return None


def _window(text: str) -> tuple[float, float | None]:
    """``START:END`` seconds (END may be empty: to the trace's end)."""
    head, sep, tail = text.partition(":")
    try:
        start = float(head) if head else 0.0
        end = float(tail) if tail else None
    except ValueError:
        start, end = -1.0, None
    if not sep or start < 0 or (end is not None and not end > start):
        raise argparse.ArgumentTypeError(
            f"must be START:END seconds with 0 <= START < END (END may be empty), got {text!r}"
        )
    return start, end


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


def _read_trace(args: argparse.Namespace, model_tokenizer: str | None) -> Trace:
    """The ``--trace`` file, windowed and scaled; an ``openai_batch`` file's prompts are
    tokenized with ``--tokenizer``, else the model config's tokenizer, else the byte
    rule."""
    from inference_lab.errors import ConfigError
    from inference_lab.traffic.traces import detect_format, read_trace

    fmt = args.trace_format or detect_format(Path(args.trace))
    tokenize = None
    if fmt == "openai_batch":
        from inference_lab.api.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
        from inference_lab.sim.batch_files import batch_tokenizer

        path = args.tokenizer or model_tokenizer
        tokenizer: Tokenizer = ByteTokenizer() if path is None else load_tokenizer(path)
        tokenize = batch_tokenizer(tokenizer)
    elif args.tokenizer is not None or args.default_max_tokens is not None:
        raise ConfigError(
            f"{args.trace}: --tokenizer and --default-max-tokens apply to openai_batch "
            f"traces, not {fmt}"
        )
    start, end = args.window if args.window is not None else (0.0, None)
    return read_trace(
        args.trace,
        fmt,
        speedup=args.speedup,
        start=start,
        end=end,
        tokenize=tokenize,
        default_max_tokens=args.default_max_tokens,
    )


def _run_on_ray(
    args: argparse.Namespace, deployment: Deployment, workload: Workload | Trace
) -> SimResult:
    """``--ray``: the run sharded across Ray workers (``inference_lab.sim.fleet``), with a
    progress bar of shards unless quiet."""
    import importlib.util

    from inference_lab.errors import ConfigError
    from inference_lab.sim.fleet import run_on_ray
    from inference_lab.sim.sharding import check_shardable

    check_shardable(deployment, workload)  # (before Ray is looked for)
    if importlib.util.find_spec("ray") is None:  # looked up, not imported
        raise ConfigError("--ray needs Ray: pip install 'inference-lab[ray]'")
    bar: Any = None
    if not (args.quiet or args.no_progress):
        from tqdm import tqdm

        bar = tqdm(unit="shard", desc="sim", file=sys.stderr, disable=None, dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        return run_on_ray(
            args.ray, deployment, workload, seed=args.seed, shards=args.shards, progress=progress
        )
    finally:
        if bar is not None:
            bar.close()


@dataclass(frozen=True)
class _Source:
    """The run's requests as loaded: the workload or trace, the file it came from (as the
    configuration print names it) and the seed the print reports."""

    workload: Workload | Trace
    name: str
    seed: int


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``sim`` command; returns the exit code (Rule 2)."""
    from inference_lab.errors import InferenceLabError
    from inference_lab.sim.text import format_config, format_summary

    code = _check_flags(args)
    if code is not None:
        return code
    try:
        deployment = _deployment(args)
        source = _load_source(args, deployment)
        if not args.quiet:
            print(format_config(deployment, source.workload, source.name, source.seed), flush=True)
        result = _simulate(args, deployment, source.workload)
        if not args.quiet:
            print()
        print(format_summary(result))
        _write_outputs(args, result, deployment, source)
    except InferenceLabError as exc:
        return fail(PROG, str(exc))
    except OSError as exc:
        return fail(PROG, _os_error_message(exc))
    return EXIT_OK


def _check_flags(args: argparse.Namespace) -> int | None:
    """Rule 3 and the flag combinations argparse cannot express: the exit code after the
    one-line error, or None when the flags may run."""
    try:
        check_output("-o", args.output)
        check_output("--request-csv", args.request_csv)
        check_output("--report", args.report)
        check_output("--timeseries", args.timeseries)
        check_output("--write-sessions", args.write_sessions)
    except ValueError as exc:
        return fail(PROG, str(exc))
    conflict = _fleet_flags_conflict(args)
    if conflict is not None:
        return fail(PROG, conflict, 2)
    wants_series = args.report is not None or args.timeseries is not None
    if args.series_interval is not None and not wants_series:
        return fail(PROG, "--series-interval applies to --report and --timeseries only", 2)
    if args.write_sessions is not None and args.workload is None:
        return fail(PROG, "--write-sessions applies to a --workload with [sessions]", 2)
    if args.workload is not None:
        for flag, value in (
            ("--trace-format", args.trace_format),
            ("--trace-window", args.window),
            ("--tokenizer", args.tokenizer),
            ("--default-max-tokens", args.default_max_tokens),
        ):
            if value is not None:
                return fail(PROG, f"{flag} applies to --trace only", 2)
        if args.speedup != 1.0:
            return fail(PROG, "--speedup applies to --trace only", 2)
    elif args.seed is not None:
        return fail(PROG, "--seed applies to --workload only (a trace draws nothing)", 2)
    return None


def _deployment(args: argparse.Namespace) -> Deployment:
    """``--config`` and ``--hardware``'s deployment with the flags' scheduler limits, its
    ``--pd`` split and ``--replicas``."""
    from inference_lab.core.config import (
        load_model_config,
        override_scheduler,
        select_deployment,
        split_pd,
    )
    from inference_lab.resources import default_hardware, resolve_shipped

    config_path = resolve_shipped(args.config, "config", "--config")
    model_config = load_model_config(config_path, args.profiles_dir)
    hardware = args.hardware or default_hardware(model_config.deployments)
    deployment = override_scheduler(
        select_deployment(model_config, hardware),
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
    )
    if args.pd is not None:
        deployment = split_pd(deployment, *args.pd)
    if args.replicas is not None:
        from inference_lab.sim.shard import shard_deployment

        deployment = shard_deployment(deployment, args.replicas)
    return deployment


def _load_source(args: argparse.Namespace, deployment: Deployment) -> _Source:
    """The trace or the workload; a session workload's sessions written for
    ``--write-sessions`` (a workload without ``[sessions]``: ``ConfigError``)."""
    from inference_lab.core.config import load_workload
    from inference_lab.errors import ConfigError
    from inference_lab.resources import resolve_shipped

    if args.trace is not None:
        args.trace = str(resolve_shipped(args.trace, "trace", "--trace"))
        return _Source(_read_trace(args, deployment.model.tokenizer), args.trace, 0)
    workload_path = resolve_shipped(args.workload, "workload", "--workload")
    workload = load_workload(workload_path)
    source = str(workload_path)
    seed = workload.seed if args.seed is None else args.seed
    if args.write_sessions is not None:
        if workload.sessions is None:
            raise ConfigError(f"--write-sessions: {source} has no [sessions] table")
        from inference_lab.traffic.sessions import write_sessions
        from inference_lab.workload import session_records

        write_sessions(args.write_sessions, session_records(workload, args.seed))
    return _Source(workload, source, seed)


def _simulate(
    args: argparse.Namespace, deployment: Deployment, workload: Workload | Trace
) -> SimResult:
    """The run: on Ray with ``--ray``, else here, with a progress bar unless quiet and a
    time series for ``--report`` / ``--timeseries``."""
    from inference_lab.sim.run import run_simulation
    from inference_lab.traffic.traces import Trace

    progress: Callable[[Progress], None] | None = None
    close: Callable[[], None] = lambda: None  # noqa: E731
    if not (args.quiet or args.no_progress or args.ray is not None):
        total = (
            len(workload.requests)
            if isinstance(workload, Trace)
            else (workload.num_requests if workload.sessions is None else None)
        )
        progress, close = _progress_bar(total)
    try:
        if args.ray is not None:
            return _run_on_ray(args, deployment, workload)
        from inference_lab.sim.series import DEFAULT_INTERVAL

        wants_series = args.report is not None or args.timeseries is not None
        interval = args.series_interval or DEFAULT_INTERVAL
        return run_simulation(
            deployment,
            workload,
            seed=args.seed,
            progress=progress,
            series_interval=interval if wants_series else None,
        )
    finally:
        close()


def _write_outputs(
    args: argparse.Namespace, result: SimResult, deployment: Deployment, source: _Source
) -> None:
    """Rule 3's second half: ``-o``, ``--request-csv``, ``--timeseries`` and ``--report``
    after the run."""
    from inference_lab.sim.text import config_dict, format_config, write_request_csv

    workload, name, seed = source.workload, source.name, source.seed
    if args.output is not None:
        doc = {
            "config": config_dict(deployment, workload, name, seed),
            **result.to_dict(),
        }
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    if args.request_csv is not None:
        with open(args.request_csv, "w", encoding="utf-8", newline="") as fh:
            write_request_csv(result, fh)
    if args.timeseries is not None and result.series is not None:
        with open(args.timeseries, "w", encoding="utf-8", newline="") as fh:
            result.series.write_csv(fh)
    if args.report is not None:
        from inference_lab.sim.report import write_report

        with open(args.report, "w", encoding="utf-8") as fh:
            write_report(
                result,
                config_dict(deployment, workload, name, seed),
                format_config(deployment, workload, name, seed),
                fh,
            )
