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
Rule 3: the report's files are written into ``--out-dir`` (``plan.json``, ``plan.csv``,
        ``pareto.png`` when matplotlib is installed); the cache lives in
        ``--cache`` (default ``<out>/cache``), shared by any plans pointed at it.
Rule 4: before any search, one line on stderr (``-q`` too) says how many candidates and
        simulations the plan holds and how long it should take (:mod:`.estimate`); a spec
        of more than ``--max-candidates`` candidates (default
        :data:`DEFAULT_MAX_CANDIDATES`) is refused after that line, exit 1, having built
        none of them. The progress bar is on stderr with ``-q`` too (``--no-progress``
        turns it off); ``-q`` only trims stdout to the cheapest lines.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import EXIT_OK, fail, integer

if TYPE_CHECKING:
    from inference_lab.executors.backends import Executor
    from inference_lab.plan.cache import ResultCache
    from inference_lab.plan.jobs import Job, ProbeResult
    from inference_lab.plan.planner import PlanProgress
    from inference_lab.plan.spec import PlanSpec

__all__ = ["add_parser", "run"]

PROG = "inference-lab plan"
#: Rule 4: the largest candidate space planned without ``--max-candidates``.
DEFAULT_MAX_CANDIDATES = 1000
#: Candidates looked at, at most, for a runnable one to time (Rule 4).
_PROBE_SEARCH = 64


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` and its flags on the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        description="Find, for each candidate deployment of a spec, the highest request rate "
        "that meets every SLO, and rank the candidates by cost (docs/planning.md).",
    )
    parser.add_argument(
        "spec",
        type=Path,
        metavar="SPEC",
        help="the plan spec: a TOML file, or the name of a shipped one (chat-20rps)",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument(
        "--out-dir",
        dest="out",
        type=Path,
        metavar="DIR",
        help="where plan.json, plan.csv and pareto.png go (default: plan-<spec name>)",
    )
    # The older spelling: every other command's -o names a file, so it says so when used.
    out.add_argument("-o", "--out", dest="out_legacy", type=Path, help=argparse.SUPPRESS)
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
        "--max-candidates",
        type=integer(ge=1),
        default=DEFAULT_MAX_CANDIDATES,
        metavar="N",
        help=f"refuse a spec of more than N candidates (default {DEFAULT_MAX_CANDIDATES:,}); "
        "the line printed first says how many and how long",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only the cheapest lines (the estimate and the progress bar stay on stderr)",
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
        from inference_lab.executors.ray_backend import RayExecutor, probe_address

        probe_address(args.ray)  # nothing listening: one line within seconds, not ray.init's minute
        return RayExecutor(run_job, args.ray, max_retries=args.retries, num_cpus=args.workers)
    return ProcessExecutor(run_job, args.workers, max_attempts=args.retries + 1)


def _ray_hint(args: argparse.Namespace, exc: Exception) -> str:
    """What to try when ``--ray ADDRESS`` could not connect and this process has no token
    mode: the cluster may authenticate (docs/planning.md, "How the token travels")."""
    from inference_lab.executors.ray_backend import NoClusterThere

    if args.ray in (None, "local") or not isinstance(exc, ConnectionError):
        return ""
    if isinstance(exc, NoClusterThere):  # nothing listens: no token would help
        return ""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return " (with RAY_AUTH_MODE=token: is the token the head's?)"
    return (
        " (if the cluster uses token authentication, set RAY_AUTH_MODE=token and its token "
        "in RAY_AUTH_TOKEN or ~/.ray/auth_token)"
    )


def _time_first_probe(spec: PlanSpec, cache: ResultCache) -> tuple[float | None, set[str]]:
    """Rule 4: the wall seconds of the first runnable candidate's first probe (from the
    cache, else run here and cached for the plan), and the keys run here (the planner's
    ``primed``). None when none of the first candidates can run."""
    from itertools import islice

    from inference_lab.plan.jobs import run_job
    from inference_lab.plan.planner import first_job
    from inference_lab.plan.spec import iter_candidates

    for cand in islice(iter_candidates(spec), _PROBE_SEARCH):
        if cand.deployment is None:
            continue
        job = first_job(spec, cand)
        cached = cache.get(job.key)
        if cached is not None:
            return cached.wall_s, set()
        result = run_job(job)
        cache.put(result)
        return result.wall_s, {job.key}
    return None, set()


def _prepare(args: argparse.Namespace) -> tuple[PlanSpec, int, Path, ResultCache] | str:
    """The spec (a path or a shipped name), its candidate count, the output directory and
    the cache; or the one-line error."""
    from inference_lab.errors import InferenceLabError
    from inference_lab.plan.cache import ResultCache
    from inference_lab.plan.spec import count_candidates, load_spec
    from inference_lab.resources import resolve_shipped

    if getattr(args, "out_legacy", None) is not None:
        print(
            f"{PROG}: note: -o/--out DIR is spelled --out-dir DIR now (-o names a file in "
            "the other commands)",
            file=sys.stderr,
        )
        args.out = args.out_legacy
    out: Path = args.out if args.out is not None else Path(f"plan-{args.spec.stem}")
    try:
        spec = load_spec(resolve_shipped(args.spec, "plan", "SPEC"))
        total = count_candidates(spec)
    except InferenceLabError as exc:
        return str(exc)
    try:
        out.mkdir(parents=True, exist_ok=True)
        cache = ResultCache(args.cache if args.cache is not None else out / "cache")
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror}"
    return spec, total, out, cache


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``plan`` command; returns the exit code (Rules 2 and 4)."""
    from inference_lab.executors.backends import default_workers
    from inference_lab.plan.estimate import estimate
    from inference_lab.plan.jobs import code_version
    from inference_lab.plan.output import format_report, plan_dict, plot_pareto, write_csv
    from inference_lab.plan.planner import run_plan
    from inference_lab.plan.report import rows
    from inference_lab.plan.spec import iter_candidates

    prepared = _prepare(args)
    if isinstance(prepared, str):
        return fail(PROG, prepared)
    spec, total, out, cache = prepared
    probe_s, primed = _time_first_probe(spec, cache)
    if total > args.max_candidates:
        guess = 1 if args.inline else (args.workers or default_workers())
        print(f"{PROG}: {estimate(spec, total, probe_s, guess).line()}", file=sys.stderr)
        return fail(
            PROG,
            f"{args.spec}: {total:,} candidates is more than --max-candidates "
            f"{args.max_candidates:,}: narrow the spec's axes, or pass --max-candidates {total}",
        )
    try:
        executor = _executor(args)
    except (ValueError, ConnectionError, RuntimeError) as exc:
        return fail(PROG, str(exc) + _ray_hint(args, exc))
    print(f"{PROG}: {estimate(spec, total, probe_s, executor.parallelism).line()}", file=sys.stderr)
    if not args.quiet:
        print(
            f"plan       {args.spec}: {total} candidates, {len(spec.slo_sets)} SLO set(s), "
            f"probes of {spec.search.duration_s:g} s of arrivals, seed {spec.seed}",
            flush=True,
        )
    progress: Callable[[PlanProgress], None] | None = None
    close: Callable[[], None] = lambda: None  # noqa: E731
    if not args.no_progress:
        progress, close = _progress_bar(total)
    try:
        result = run_plan(
            spec,
            iter_candidates(spec),
            executor,
            cache,
            progress=progress,
            total=total,
            primed=primed,
        )
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
