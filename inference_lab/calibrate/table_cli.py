"""``inference-lab calibrate --table FILE --entry NAME``: fit one calibrated entry (a GPU
and engine) to every row of a measurement table that names it, across the models the rows
cover, and report the fit per model, per load level and out of sample.

Called by :mod:`inference_lab.calibrate.cli` (its flags and :func:`run_table`); the rows
are read by :mod:`inference_lab.calibrate.table`, fitted by
:mod:`inference_lab.calibrate.tablefit`.

Rule 1: every row is checked before any simulation (Rule 3 of
        :mod:`inference_lab.calibrate.table`: the entry exists, the deployment holds the
        weights and one request, the latencies are not seconds in a millisecond column);
        the first problem is one line and exit 1.
Rule 2: the snippet is the profile's tables, ``[efficiency]`` (and ``[overheads]`` when
        ``seq_overhead`` is fitted), with every term of the table, to paste into the
        entry's ``hardware_profiles/<entry>.toml``; it never writes the profile itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import EXIT_OK, fail, integer

if TYPE_CHECKING:
    from inference_lab.calibrate.fit import FitResult, Mapper
    from inference_lab.calibrate.table import Case
    from inference_lab.calibrate.tablefit import Fold, GroupError

__all__ = ["add_table_arguments", "format_groups", "run_table", "table_snippet"]

PROG = "inference-lab calibrate"
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL p50", "throughput": "tok/s", "step": "step"}


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """The table mode's flags, on ``calibrate``'s parser."""
    parser.add_argument(
        "--table",
        type=Path,
        metavar="CSV",
        help="a measurement table (docs/fidelity/measurements.csv's columns): fit --entry "
        "to every row that names it, across its models",
    )
    parser.add_argument(
        "--entry", metavar="NAME", help="with --table: the calibrated entry to fit (h100-vllm)"
    )
    parser.add_argument(
        "--holdout",
        choices=("model", "concurrency"),
        action="append",
        help="with --table: also fit without each model in turn (model) or without each "
        "half of the load levels (concurrency) and report the held-out rows (repeatable)",
    )
    parser.add_argument(
        "--configs-dir",
        type=Path,
        action="append",
        metavar="DIR",
        help="with --table: where the rows' model configs are (repeatable; searched before "
        "the shipped configs/fidelity, configs/frontier and configs)",
    )
    parser.add_argument(
        "--workers",
        type=integer(ge=1),
        default=1,
        metavar="N",
        help="with --table: simulations in parallel (default 1)",
    )


@contextmanager
def _mapper(workers: int) -> Iterator[Mapper]:
    if workers <= 1:
        yield map
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        yield lambda func, jobs: list(pool.map(func, jobs))


def load_cases(args: argparse.Namespace) -> list[Case]:
    """Rule 1: the entry's rows as cases, every row checked."""
    from inference_lab.calibrate.table import check_units, config_finder, read_table, row_cases
    from inference_lab.errors import ConfigError
    from inference_lab.resources import shipped_dir

    rows = [r for r in read_table(args.table) if r["entry"] == args.entry]
    if not rows:
        raise ConfigError(f"{args.table}: entry: no row names {args.entry!r}")
    shipped = shipped_dir("configs")
    dirs = list(args.configs_dir or []) + [shipped / "fidelity", shipped / "frontier", shipped]
    cases = row_cases(rows, config_finder(dirs), args.profiles_dir)
    for case in cases:
        check_units(case)
    return cases


def run_table(args: argparse.Namespace, names: Sequence[str]) -> int:
    """Run the table mode (Rule 1 for errors); returns the exit code."""
    from inference_lab.calibrate.fit import mape
    from inference_lab.calibrate.tablefit import fit_entry, group_errors, holdout
    from inference_lab.errors import InferenceLabError

    try:
        cases = load_cases(args)
        models = sorted({c.row["model_config"] for c in cases})
        print(
            f"calibrate  {args.entry} from {args.table}: {len(cases)} row(s) of "
            f"{len(models)} model(s) ({', '.join(models)}); fitting {', '.join(names)}",
            flush=True,
        )
        with _mapper(args.workers) as mapper:
            result = fit_entry(cases, names, args.sim_requests, mapper)
            folds = {
                by: holdout(cases, names, by, args.sim_requests, mapper)
                for by in args.holdout or []
            }
        print(format_fit(result))
        for key in ("model", "level"):
            print()
            print(format_groups(group_errors(cases, result.cases_after, key), key))
        for by, fold_list in folds.items():
            print()
            print(format_holdout(by, fold_list, models))
        text = table_snippet(args.entry, str(args.table), cases, result, mape)
        if args.output is not None:
            args.output.write_text(text, encoding="utf-8")
            print(f"\nwrote {args.output}")
        else:
            print()
            print(text, end="")
    except InferenceLabError as exc:
        return fail(PROG, str(exc))
    except OSError as exc:
        return fail(PROG, f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    return EXIT_OK


def format_fit(result: FitResult) -> str:
    """The fitted values and the MAPE per metric before and after."""
    from inference_lab.calibrate.fit import mape, shown

    lines = [
        "fitted     "
        + ", ".join(
            f"{n} {shown(n, v)} (from {shown(n, i)})"
            for n, v, i in zip(result.names, result.values, result.initial, strict=True)
        ),
        f"           {result.iterations} iterations, {result.evaluations} evaluations",
        "",
        f"{'metric':<11}{'n':>4}{'MAPE before':>13}{'MAPE after':>12}",
    ]
    before, after = mape(result.before), mape(result.after)
    for metric in before:
        n = len(result.before.pairs[metric])
        lines.append(f"{metric:<11}{n:>4}{before[metric]:>12.1f}%{after[metric]:>11.1f}%")
    return "\n".join(lines)


def _cell(value: tuple[float, float, int] | None) -> str:
    if value is None:
        return "–"
    return f"{value[0]:.1f}% ({value[1]:+.1f}%)"


def format_groups(groups: Sequence[GroupError], key: str) -> str:
    """Rule 3 of :mod:`~inference_lab.calibrate.tablefit`: MAPE (mean signed error) per
    metric, one line per model or load level."""
    order = ("ttft", "tpot", "itl", "throughput")
    metrics = [m for m in order if any(m in g.metrics for g in groups)]
    title = "per model" if key == "model" else "per load level"
    width = max([len(g.group) for g in groups] + [12])
    lines = [f"residuals {title}: MAPE (mean signed error)"]
    lines.append(f"{'':<{width}}{'rows':>6}" + "".join(f"{_NAMES[m]:>20}" for m in metrics))
    for g in groups:
        cells = "".join(f"{_cell(g.metrics.get(m)):>20}" for m in metrics)
        lines.append(f"{g.group:<{width}}{g.rows:>6}" + cells)
    return "\n".join(lines)


def format_holdout(by: str, folds: Sequence[Fold], models: Sequence[str]) -> str:
    """Each fold's held-out rows: their MAPE (mean signed error) per metric, and the
    values fitted without them."""
    from inference_lab.calibrate.fit import shown
    from inference_lab.calibrate.tablefit import not_run, pooled

    if not folds:
        reason = f"one model ({', '.join(models)})" if by == "model" else "one load level"
        return f"held out by {by}: {reason}, nothing to hold out"
    lines = [f"held out by {by} (fitted without the held-out rows): MAPE (mean signed error)"]
    for fold in folds:
        if fold.unfitted:
            lines.append(
                f"  {fold.held_out}: {len(fold.tested_on)} rows: not fitted: {fold.unfitted}"
            )
            continue
        errors = pooled(fold.predictions)
        cells = ", ".join(f"{_NAMES[m]} {_cell(v)}" for m, v in errors.items())
        failed = not_run(fold.predictions)
        if failed:
            cells += f"{', ' if cells else ''}{failed} did not run (no request fits the KV cache)"
        fitted = ", ".join(f"{n} {shown(n, v)}" for n, v in fold.values.items())
        lines.append(f"  {fold.held_out}: {len(fold.tested_on)} rows: {cells}  [{fitted}]")
    return "\n".join(lines)


def table_snippet(
    entry: str, source: str, cases: Sequence[Case], result: FitResult, mape: Any
) -> str:
    """Rule 2: the profile's tables with the fitted values (and the terms not fitted at
    the entry's own values), the errors before and after as comments."""
    dep = cases[0].deployment
    eff = dep.efficiency
    values = {
        "memory_bandwidth": eff.memory_bandwidth,
        "flops": eff.flops,
        "step_overhead": eff.step_overhead,
    }
    for name in ("expert_skew", "layer_overhead"):
        if name in result.fitted or getattr(eff, name):
            values[name] = getattr(eff, name)
    values.update({k: v for k, v in result.fitted.items() if k in values})
    before, after = mape(result.before), mape(result.after)
    models = sorted({c.row["model_config"] for c in cases})
    lines = [
        f"# inference-lab calibrate --table {source} --entry {entry}: {len(cases)} rows, "
        + ", ".join(models),
        "# MAPE before -> after: "
        + ", ".join(f"{m} {before[m]:.1f}% -> {after[m]:.1f}%" for m in before),
        "[efficiency]",
    ]
    lines += [f"{k} = {v:.6g}" for k, v in values.items()]
    overheads = {
        key: result.fitted.get(key, getattr(dep.overheads, key))
        for key in ("seq_overhead", "frontend_latency", "reserved_memory")
    }
    if any(overheads.values()) or set(overheads) & set(result.fitted):
        lines += ["", "[overheads]"] + [f"{k} = {v:.6g}" for k, v in overheads.items()]
    return "\n".join(lines) + "\n"
