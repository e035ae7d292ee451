"""``inference-lab plan``: flags, the backend, the progress bar, the report and its files.

``cli.py`` calls :func:`add_parser` and then :func:`run`. The planning itself is
:func:`inference_lab.plan.planner.run_plan`.

Rule 1: this module's top level imports only the standard library and the flag toolkit;
        ``run`` imports the planner (numpy, the engine), and Ray only with ``--ray``.
        Nothing here imports the serve stack.
Rule 2: bad input (a spec, config or workload that is missing or invalid, an output
        directory that cannot be made, ``--ray`` without the ``ray`` extra) is one line on
        stderr and exit 1; a candidate that cannot run is a row of the report, not an
        error. Ctrl-C stops the workers, leaves the cache consistent (cache.py Rule 1) and
        exits 130 (``cli.py``); running the same command again resumes.
Rule 3: the report's files are written into ``--out`` (``plan.json``, ``plan.csv``,
        ``pareto.png`` when matplotlib is installed); the cache lives in
        ``--cache`` (default ``<out>/cache``), shared by any plans pointed at it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import EXIT_OK, fail, integer

if TYPE_CHECKING:
    from inference_lab.executors.backends import Executor
    from inference_lab.plan.jobs import Job, ProbeResult
    from inference_lab.plan.planner import PlanProgress

__all__ = ["add_parser", "run"]

PROG = "inference-lab plan"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` and its flags on the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        description="Find, for each candidate deployment of a spec, the highest request rate "
        "that meets every SLO, and rank the candidates by cost (docs/planning.md).",
    )
    parser.add_argument("spec", type=Path, metavar="SPEC.toml", help="the plan spec")
    parser.add_argument(
        "-o",
        "--out",
        type=Path,
        metavar="DIR",
        help="where plan.json, plan.csv and pareto.png go (default: plan-<spec name>)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="the results cache (default: <out>/cache); plans may share one",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-j",
        "--workers",
        type=integer(ge=1),
        metavar="N",
        help="local worker processes (default: one per core)",
    )
    where.add_argument("--inline", action="store_true", help="run every simulation in this process")
    where.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run simulations as Ray tasks: 'local' (a private Ray instance), 'auto' (the "
        "cluster this machine belongs to) or a cluster address (host:port, ray://...)",
    )
    parser.add_argument(
        "--retries",
        type=integer(ge=0),
        default=3,
        metavar="N",
        help="run a job again up to N times when its worker dies (default 3)",
    )
    parser.add_argument(
        "--top", type=integer(ge=1), default=20, metavar="N", help="rows per table (default 20)"
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar, only the cheapest lines"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )
    return parser


def _progress_bar(total: int) -> tuple[Callable[[PlanProgress], None], Callable[[], None]]:
    from tqdm import tqdm

    bar = tqdm(
        total=total,
        unit="cand",
        desc="plan",
        file=sys.stderr,
        disable=None,
        dynamic_ncols=True,
    )

    def update(p: PlanProgress) -> None:
        bar.set_postfix_str(
            f"sims {p.jobs_run} run, {p.jobs_cached} cached, {p.jobs_in_flight} running",
            refresh=False,
        )
        bar.update(p.candidates_done - bar.n)  # redraws at most every 0.1 s, even by 0

    return update, bar.close


def _executor(args: argparse.Namespace) -> Executor[Job, ProbeResult]:
    from inference_lab.executors.backends import InlineExecutor, ProcessExecutor
    from inference_lab.plan.jobs import run_job

    if args.inline:
        return InlineExecutor(run_job)
    if args.ray is not None:
        if importlib.util.find_spec("ray") is None:  # looked up, not imported (ray_backend Rule 3)
            raise ValueError("--ray needs Ray: pip install 'inference-lab[ray]'")
        from inference_lab.executors.ray_backend import RayExecutor

        return RayExecutor(run_job, args.ray, max_retries=args.retries, num_cpus=args.workers)
    return ProcessExecutor(run_job, args.workers, max_attempts=args.retries + 1)


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``plan`` command; returns the exit code (Rule 2)."""
    from inference_lab.errors import InferenceLabError
    from inference_lab.plan.cache import ResultCache
    from inference_lab.plan.jobs import code_version
    from inference_lab.plan.planner import run_plan
    from inference_lab.plan.report import format_report, plan_dict, plot_pareto, rows, write_csv
    from inference_lab.plan.spec import expand_candidates, load_spec

    out: Path = args.out if args.out is not None else Path(f"plan-{args.spec.stem}")
    try:
        spec = load_spec(args.spec)
        candidates = expand_candidates(spec)
    except InferenceLabError as exc:
        return fail(PROG, str(exc))
    try:
        out.mkdir(parents=True, exist_ok=True)
        cache = ResultCache(args.cache if args.cache is not None else out / "cache")
    except OSError as exc:
        return fail(PROG, f"{exc.filename}: {exc.strerror}")
    try:
        executor = _executor(args)
    except (ValueError, ConnectionError, RuntimeError) as exc:
        return fail(PROG, str(exc))
    if not args.quiet:
        runnable = sum(1 for c in candidates if c.deployment is not None)
        print(
            f"plan       {args.spec}: {len(candidates)} candidates ({runnable} can run), "
            f"{len(spec.slo_sets)} SLO set(s), probes of {spec.search.duration_s:g} s of arrivals, "
            f"seed {spec.seed}",
            flush=True,
        )
    progress: Callable[[PlanProgress], None] | None = None
    close: Callable[[], None] = lambda: None  # noqa: E731
    if not (args.quiet or args.no_progress):
        progress, close = _progress_bar(len(candidates))
    try:
        result = run_plan(spec, candidates, executor, cache, progress=progress)
    finally:
        close()
        executor.close()
    ranked = rows(result)
    text = format_report(result, ranked, limit=args.top)
    if args.quiet:
        text = "\n".join(line for line in text.splitlines() if line.startswith("cheapest"))
    print(text)
    try:
        with open(out / "plan.json", "w", encoding="utf-8") as fh:
            json.dump(plan_dict(result, ranked, code_version()), fh, indent=2)
            fh.write("\n")
        with open(out / "plan.csv", "w", encoding="utf-8", newline="") as fh:
            write_csv(ranked, spec.slo_sets, fh)
        written = ["plan.json", "plan.csv"]
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            note = " (no pareto.png: pip install 'inference-lab[plan]')"
        else:
            plot_pareto(out / "pareto.png", result, ranked)
            written.append("pareto.png")
            note = ""
    except OSError as exc:
        return fail(PROG, f"{exc.filename}: {exc.strerror}")
    if not args.quiet:
        print(f"wrote      {', '.join(str(out / w) for w in written)}{note}")
    return EXIT_OK
