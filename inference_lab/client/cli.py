"""``inference-lab load``: argument parsing, progress bar, report files.

``add_parser(subparsers)`` registers the sub-command (and sets ``func=run``); ``run(args)``
executes a parsed command and returns the exit code; ``main(argv)`` is the stand-alone entry
point behind ``python -m inference_lab.client``.

Exit codes: 0 the run completed (whatever the server answered); 1 the server was
unreachable before the run or a result file could not be written; 2 bad arguments
(argparse's own errors, and combinations it cannot express, in the same one-line form);
130 the run was interrupted by Ctrl-C (its partial report is still printed and written).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from tqdm import tqdm

from .load import LoadConfig, LoadError, LoadResult, RequestRecord, Sample, run_load
from .report import format_summary, summarize, write_csv, write_json

__all__ = ["add_parser", "build_parser", "config_from_args", "main", "run"]

PROG = "inference-lab load"


def _int_at_least(lowest: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lowest``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _nonnegative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True, help="model id sent in every request")
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
    bound = p.add_mutually_exclusive_group(required=True)
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
    p.add_argument("--prompt-tokens", type=_positive_int, default=50, metavar="N")
    p.add_argument("--max-tokens", type=_positive_int, default=200, metavar="N")
    p.add_argument("--no-stream", action="store_true", help="ask for whole (non-streamed) answers")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the summary as JSON")
    p.add_argument("--csv", type=Path, metavar="FILE", help="write one row per request")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or log lines")
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
        type=_positive_float,
        metavar="F",
        help="multiply the limit by F on a 529, at most once per window (default 0.5)",
    )
    a.add_argument(
        "--max-retries",
        type=_nonnegative_int,
        metavar="N",
        help="retries of a 529'd request before giving up (default 10)",
    )
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="draw limit, latency and 529 rate over time"
    )
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
    x.add_argument("--seed", type=int, help="seed for open-loop arrival times")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``load`` on an ``argparse`` sub-parsers object; ``func`` is set to ``run``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "load",
        help="drive a server with closed-loop, open-loop or adaptive (AIMD) load",
        description="Load generator for an OpenAI-compatible server (see the README's load-generation section).",
    )
    _configure(p)
    p.set_defaults(func=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Load generator for an OpenAI-compatible server (see the README's load-generation section).",
    )
    _configure(p)
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build the run's config; ``ValueError`` (one line) for combinations argparse allows
    but the run does not."""
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
        **extra,
    )


def _check_output(flag: str, path: Path | None) -> str | None:
    if path is None:
        return None
    if path.is_dir():
        return f"{flag} {path}: is a directory"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"{flag} {path}: directory {parent} does not exist"
    return None


class _Progress:
    """tqdm on stderr: requests done (``--requests``) or seconds elapsed (``--duration``)."""

    def __init__(self, config: LoadConfig, quiet: bool) -> None:
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


async def _sigint_to_stop(stop: trio.Event, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    # The first Ctrl-C ends the run and keeps the partial report; leaving the receiver
    # restores the default handler, so a second one interrupts outright.
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            stop.set()
            return


async def _drive(config: LoadConfig, progress: _Progress) -> LoadResult:
    stop = trio.Event()
    result: LoadResult | LoadError
    async with trio.open_nursery() as nursery:
        if threading.current_thread() is threading.main_thread():
            await nursery.start(_sigint_to_stop, stop)
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


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``load`` command; returns the exit code."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for flag, path in (("-o", args.output), ("--csv", args.csv), ("--plot", args.plot)):
        problem = _check_output(flag, path)
        if problem is not None:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return 1
    progress = _Progress(config, args.quiet)
    try:
        result = trio.run(_drive, config, progress)
    except LoadError as exc:
        progress.close()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    progress.close()
    summary = summarize(result)
    print(format_summary(result, summary), flush=True)
    try:
        if args.output is not None:
            write_json(args.output, result, summary)
        if args.csv is not None:
            write_csv(args.csv, result)
        if args.plot is not None:
            from .plot import plot_timeseries  # matplotlib is slow to import; only when asked

            plot_timeseries(args.plot, result, summary)
    except OSError as exc:
        print(f"{PROG}: error: cannot write result: {exc}", file=sys.stderr)
        return 1
    return 130 if result.interrupted else 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m inference_lab.client ARGS``."""
    return run(build_parser().parse_args(argv))
