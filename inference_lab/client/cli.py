"""``inference-lab load``: flags, progress bar, report files.

``cli.py`` calls :func:`add_parser` and then :func:`run`. The load itself is
:func:`inference_lab.client.load.run_load`.

Rule 1: this module's top level imports only the standard library and the flag toolkit, so
        parsing (``--help``, a bad flag) costs no trio or numpy; ``run`` imports the client.
Rule 2: exit codes follow ``cli.py``: 0 the run completed and at least one request
        succeeded; 1 the server was unreachable before the run, does not serve
        ``--model``, every request of the run failed (the summary and the files are still
        written; the error line quotes the first failure), a result file cannot be
        written, or ``--plot`` was asked without matplotlib; 2 bad flags (argparse's own
        errors, and combinations it cannot express, in the same one-line form); 130 the
        run was interrupted by Ctrl-C (its partial report is still printed and written).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    check_output,
    fail,
    integer,
    number,
)

if TYPE_CHECKING:
    from inference_lab.traffic.sessions import SessionRecord
    from inference_lab.traffic.traces import Trace

    from .load import LoadConfig, LoadResult, RequestRecord, Sample
    from .replay import ReplayConfig, ReplayError, ReplayResult

__all__ = ["add_parser", "run"]

PROG = "inference-lab load"

_positive_int = integer(ge=1)
_nonnegative_int = integer(ge=0)
_positive_float = number(gt=0)
_nonnegative_float = number(ge=0)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``load`` and its flags on the top-level CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "load",
        description="Load generator for an OpenAI-compatible server: closed loop "
        "(--concurrency), open loop (--rate) or adaptive (--adaptive aimd), bounded by "
        "--duration or --requests; or a replay of multi-turn sessions (--sessions) or of a "
        "trace (--trace).",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument(
        "--model",
        required=True,
        help="model id sent in every request; checked against GET /v1/models before the run",
    )
    _add_loop_arguments(p)
    _add_request_arguments(p)
    _add_output_arguments(p)
    _add_adaptive_arguments(p)
    _add_replay_arguments(p)
    _add_bounds_arguments(p)
    return p


def _add_loop_arguments(p: argparse.ArgumentParser) -> None:
    """The loop (closed, open) and its bound (duration, requests, warm-up)."""
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="N",
        help="closed loop: N workers (with --adaptive: the starting limit, default 1)",
    )
    shape.add_argument(
        "--rate", type=_positive_float, metavar="R", help="open loop: Poisson arrivals per second"
    )
    p.add_argument(
        "--max-concurrency",
        type=_positive_int,
        metavar="N",
        help="with --rate: cap on requests in flight; with --adaptive: the ceiling (1024)",
    )
    bound = p.add_mutually_exclusive_group()
    bound.add_argument(
        "--duration", type=_positive_float, metavar="S", help="send requests for S seconds"
    )
    bound.add_argument("--requests", type=_positive_int, metavar="N", help="send N requests")
    p.add_argument(
        "--warmup",
        type=_nonnegative_float,
        default=0.0,
        metavar="S",
        help="leave requests started in the first S seconds out of the statistics",
    )


def _add_request_arguments(p: argparse.ArgumentParser) -> None:
    """What each request asks for and how the client treats its answer."""
    p.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=50,
        metavar="N",
        help="prompt size in tokens as the server counts them without a tokenizer (default 50)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=200,
        metavar="N",
        help="max_tokens of every request: the answer's length in tokens (default 200)",
    )
    p.add_argument("--no-stream", action="store_true", help="ask for whole (non-streamed) answers")
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="chat: POST /v1/chat/completions; completions: POST /v1/completions (default chat)",
    )
    p.add_argument(
        "--retry-after",
        action="store_true",
        help="after a 429, 503 or 529 with Retry-After, the worker (or the adaptive retry) "
        "waits the seconds asked, at most 60, before sending again; closed loop and "
        "--adaptive only",
    )
    p.add_argument(
        "--no-model-check",
        action="store_true",
        help="send requests without asking GET /v1/models first whether --model is served",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Where the run's summary, rows and plot go."""
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the summary as JSON")
    p.add_argument("--csv", type=Path, metavar="FILE", help="write one row per request")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or log lines")


def _add_adaptive_arguments(p: argparse.ArgumentParser) -> None:
    """``--adaptive aimd`` and its controller's dials; ``--plot``."""
    a = p.add_argument_group("adaptive concurrency")
    a.add_argument(
        "--adaptive",
        choices=("aimd",),
        help="find the sustainable concurrency from 529s (additive increase, "
        "multiplicative decrease)",
    )
    a.add_argument(
        "--window",
        type=_positive_int,
        metavar="N",
        help="successful completions per window; +1 after a window without 529 (default 8)",
    )
    a.add_argument(
        "--backoff",
        type=number(gt=0, lt=1),
        metavar="F",
        help="multiply the limit by F on a 529, at most once per window (default 0.5)",
    )
    a.add_argument(
        "--max-retries",
        type=_nonnegative_int,
        metavar="N",
        help="retries of a 529'd request before giving up (default 10)",
    )
    # the limit's plot: an option of every run (not of the group), listed after the dials
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="draw limit, latency and 529 rate over time"
    )


def _add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """``--sessions`` / ``--trace`` replays and their dials."""
    r = p.add_argument_group("replaying traffic (instead of --rate / --duration / --requests)")
    src = r.add_mutually_exclusive_group()
    src.add_argument(
        "--sessions",
        type=Path,
        metavar="FILE",
        help="replay multi-turn sessions (a session file: `inference-lab sim --write-sessions`):"
        " each turn resends the conversation after its think time; TTFT per turn. With "
        "--concurrency N, N users take the sessions in turn; else each starts at its time",
    )
    src.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay a trace at its times (mooncake / openai_batch JSONL, azure / burstgpt CSV)",
    )
    r.add_argument(
        "--trace-format",
        choices=("mooncake", "azure", "burstgpt", "openai_batch"),
        help="the trace's format (default: told from its first line)",
    )
    r.add_argument(
        "--speedup", type=_positive_float, metavar="X", help="replay the trace X times faster"
    )
    r.add_argument(
        "--trace-window",
        type=_window,
        metavar="START:END",
        help="replay only the trace's requests from START to END seconds (END may be empty)",
    )


def _add_bounds_arguments(p: argparse.ArgumentParser) -> None:
    """Time-outs, sampling and the seed."""
    x = p.add_argument_group("bounds and sampling")
    x.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="give up on one request after S seconds (default 300)",
    )
    x.add_argument(
        "--drain-timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="with --duration: cancel requests still running S seconds after it (default 30)",
    )
    x.add_argument(
        "--sample-interval",
        type=_positive_float,
        default=0.25,
        metavar="S",
        help="time-series sampling period (default 0.25; log lines at most once a second)",
    )
    x.add_argument(
        "--seed", type=_nonnegative_int, metavar="N", help="seed for open-loop arrival times"
    )


def _window(text: str) -> tuple[float, float | None]:
    """``START:END`` seconds (END may be empty)."""
    start_text, sep, end_text = text.partition(":")
    try:
        if not sep:
            raise ValueError
        start = float(start_text) if start_text.strip() else 0.0
        end = float(end_text) if end_text.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be START:END seconds, got {text!r}") from None
    if start < 0 or (end is not None and not end > start):
        raise argparse.ArgumentTypeError(f"needs 0 <= START < END, got {text!r}")
    return start, end


_REPLAY_ONLY = ("trace_format", "speedup", "trace_window")
_NOT_WITH_REPLAY = (
    "rate",
    "max_concurrency",
    "duration",
    "requests",
    "adaptive",
    "window",
    "backoff",
    "max_retries",
    "plot",
)


def _replay_config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """The replay's config (``--sessions`` / ``--trace``); ValueError (one line) for
    flags that do not go with it."""
    from .replay import ReplayConfig

    for flag in _NOT_WITH_REPLAY:
        if getattr(args, flag, None) not in (None, False):
            raise ValueError(f"--{flag.replace('_', '-')} does not go with --sessions / --trace")
    if args.warmup or args.prompt_tokens != 50 or args.max_tokens != 200 or args.no_stream:
        raise ValueError(
            "--warmup, --prompt-tokens, --max-tokens and --no-stream do not go with "
            "--sessions / --trace (the traffic sets the lengths; replays stream)"
        )
    return ReplayConfig(
        url=args.url,
        model=args.model,
        sessions=args.sessions,
        trace=args.trace,
        concurrency=args.concurrency,
        endpoint=args.endpoint,
        trace_format=args.trace_format,
        speedup=args.speedup if args.speedup is not None else 1.0,
        window=args.trace_window,
        request_timeout=args.request_timeout,
        connect_timeout=10.0,
        check_model=not args.no_model_check,
    )


def _config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build the run's config (called by :func:`run`); ``ValueError`` (one line) for
    combinations argparse allows but the run does not."""
    from .load import LoadConfig

    for flag in _REPLAY_ONLY:
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --trace")
    if args.adaptive is None:
        for flag in ("window", "backoff", "max_retries"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --adaptive")
    extra: dict[str, Any] = {}
    for flag in ("window", "backoff", "max_retries"):
        if getattr(args, flag) is not None:
            extra[flag] = getattr(args, flag)
    return LoadConfig(
        url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        rate=args.rate,
        max_concurrency=args.max_concurrency,
        duration=args.duration,
        requests=args.requests,
        warmup=args.warmup,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        stream=not args.no_stream,
        endpoint=args.endpoint,
        adaptive=args.adaptive,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        sample_interval=args.sample_interval,
        seed=args.seed,
        check_model=not args.no_model_check,
        retry_after=args.retry_after,
        **extra,
    )


class _Progress:
    """tqdm on stderr: requests done (``--requests``) or seconds elapsed (``--duration``)."""

    def __init__(self, config: LoadConfig, quiet: bool) -> None:
        from tqdm import tqdm

        self.config = config
        self.quiet = quiet
        timed = config.duration is not None
        self.timed = timed
        self.bar = tqdm(
            total=config.duration if timed else config.requests,
            unit="s" if timed else "req",
            file=sys.stderr,
            disable=True if quiet else None,  # None: tqdm's "off when not a terminal"
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n:.1f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]"
            if timed
            else None,
        )
        self.ok = 0
        self.failed = 0
        self.overloaded = 0
        self.elapsed = 0.0
        self.next_log = 1.0  # log lines on whole seconds

    def on_record(self, record: RequestRecord) -> None:
        if record.outcome == "ok":
            self.ok += 1
        elif record.outcome == "overloaded":
            self.overloaded += 1
        else:
            self.failed += 1
        if self.quiet:
            return
        if self.timed:
            self._advance(record.end)
        elif not (
            self.config.adaptive is not None
            and record.outcome == "overloaded"
            and record.attempt < self.config.max_retries
        ):
            self.bar.update(1)
        self.bar.set_postfix_str(
            f"ok={self.ok} 529={self.overloaded} err={self.failed}", refresh=False
        )

    def on_sample(self, sample: Sample) -> None:
        if self.quiet:
            return
        if self.timed:
            self._advance(sample.time)
        if self.config.adaptive is not None and sample.time >= self.next_log - 1e-6:
            self.next_log = math.floor(sample.time + 1e-6) + 1.0
            e2e = "-" if sample.e2e_mean is None else f"{sample.e2e_mean * 1000:.0f}ms"
            self.bar.write(
                f"t={sample.time:7.1f}s limit={sample.limit} in_flight={sample.in_flight} "
                f"done/s={sample.completed} 529={sample.overload_rate:.0%} e2e={e2e}",
                file=sys.stderr,
            )

    def _advance(self, t: float) -> None:
        assert self.config.duration is not None
        t = min(t, self.config.duration)
        if t > self.elapsed:
            self.bar.update(t - self.elapsed)
            self.elapsed = t

    def close(self) -> None:
        self.bar.close()


async def _drive(config: LoadConfig, progress: _Progress) -> LoadResult:
    """``run_load`` with the first Ctrl-C turned into its ``stop`` event: the run ends and
    keeps its partial report. Leaving the signal receiver restores the default handler, so
    a second Ctrl-C interrupts outright."""
    import signal

    import trio

    from .load import LoadError, run_load

    stop = trio.Event()

    async def sigint_to_stop(*, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                stop.set()
                return

    result: LoadResult | LoadError
    async with trio.open_nursery() as nursery:
        if threading.current_thread() is threading.main_thread():
            await nursery.start(sigint_to_stop)
        try:
            result = await run_load(
                config, on_record=progress.on_record, on_sample=progress.on_sample, stop=stop
            )
        except LoadError as exc:
            result = exc  # re-raised outside the nursery, so not wrapped in a group
        nursery.cancel_scope.cancel()
    if isinstance(result, LoadError):
        raise result
    return result


def _run_replay(args: argparse.Namespace) -> int:
    """``--sessions`` / ``--trace``: replay the traffic, print the per-turn report."""
    try:
        config = _replay_config_from_args(args)
    except ValueError as exc:
        return fail(PROG, str(exc), EXIT_USAGE)
    try:
        check_output("-o", args.output)
        check_output("--csv", args.csv)
    except ValueError as exc:
        return fail(PROG, str(exc))
    from inference_lab.errors import ConfigError

    from .replay import ReplayError, format_replay, load_traffic, summarize_replay

    try:
        traffic = load_traffic(config)
    except (ConfigError, ValueError) as exc:
        return fail(PROG, str(exc))
    result = _replay_until_interrupted(config, traffic)
    if isinstance(result, ReplayError):
        return fail(PROG, str(result))
    summary = summarize_replay(result)
    print(format_replay(result, summary), flush=True)
    try:
        _write_replay_outputs(args, summary, result)
    except OSError as exc:
        return fail(PROG, f"cannot write result: {exc}")
    if result.interrupted:
        return EXIT_INTERRUPTED
    if not summary["outcomes"].get("ok"):
        why = f" (first: {summary['first_error']})" if summary["first_error"] else ""
        return fail(PROG, f"all {summary['requests']} requests failed{why}", EXIT_ERROR)
    return EXIT_OK


def _replay_until_interrupted(
    config: ReplayConfig, traffic: tuple[SessionRecord, ...] | Trace
) -> ReplayResult | ReplayError:
    """Run the replay under trio, a SIGINT (on the main thread) stopping it gracefully:
    the replay's result, or the ``ReplayError`` it raised. ``_run_replay`` calls it."""
    import signal

    import trio

    from .replay import ReplayError, run_replay

    async def drive() -> ReplayResult | ReplayError:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            if threading.current_thread() is threading.main_thread():

                async def sigint(*, task_status: trio.TaskStatus[None]) -> None:
                    with trio.open_signal_receiver(signal.SIGINT) as signals:
                        task_status.started()
                        async for _ in signals:
                            stop.set()
                            return

                await nursery.start(sigint)
            try:
                result: ReplayResult | ReplayError = await run_replay(config, traffic, stop=stop)
            except ReplayError as exc:
                result = exc
            nursery.cancel_scope.cancel()
        return result

    return trio.run(drive)


def _write_replay_outputs(
    args: argparse.Namespace, summary: dict[str, Any], result: ReplayResult
) -> None:
    """``-o`` (the summary as JSON) and ``--csv`` (one row per request) of a replay;
    ``OSError`` is the caller's one-line failure."""
    import json

    from .replay import write_replay_csv

    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
            fh.write("\n")
    if args.csv is not None:
        write_replay_csv(args.csv, result)


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``load`` command; returns the exit code (Rule 2)."""
    if getattr(args, "sessions", None) is not None or getattr(args, "trace", None) is not None:
        return _run_replay(args)
    try:
        config = _config_from_args(args)
    except ValueError as exc:
        return fail(PROG, str(exc), EXIT_USAGE)
    try:
        check_output("-o", args.output)
        check_output("--csv", args.csv)
        check_output("--plot", args.plot)
    except ValueError as exc:
        return fail(PROG, str(exc))
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        return fail(PROG, "--plot needs matplotlib: pip install 'inference-lab[plot]'")

    import trio

    from .load import LoadError
    from .report import format_first_error, format_summary, summarize, write_csv, write_json

    progress = _Progress(config, args.quiet)
    try:
        result = trio.run(_drive, config, progress)
    except LoadError as exc:
        progress.close()
        return fail(PROG, str(exc))
    progress.close()
    summary = summarize(result)
    print(format_summary(result, summary), flush=True)
    try:
        if args.output is not None:
            write_json(args.output, result, summary)
        if args.csv is not None:
            write_csv(args.csv, result)
        if args.plot is not None:
            from .plot import plot_timeseries

            plot_timeseries(args.plot, result, summary)
    except OSError as exc:
        return fail(PROG, f"cannot write result: {exc}")
    if result.interrupted:
        return EXIT_INTERRUPTED
    if summary.all_failed:
        first = summary.first_error
        why = f" (first: {format_first_error(first)})" if first is not None else ""
        return fail(PROG, f"all {summary.attempts} attempts failed{why}", EXIT_ERROR)
    return EXIT_OK
