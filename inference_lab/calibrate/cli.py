"""``inference-lab calibrate``: fit a deployment's efficiency terms (or time_correction) to
measurements of a real server, report the error before and after, write a TOML snippet;
or (``--table``) fit one GPU and engine's terms to every model a measurement table covers
and report them per model, per load level and out of sample.

``cli.py`` calls :func:`add_parser` and then :func:`run`; the fit is
:func:`inference_lab.calibrate.fit.fit`, the readers :mod:`inference_lab.calibrate.measurements`;
the table mode is :mod:`inference_lab.calibrate.table_cli`.

Rule 1: this module's top level imports only the standard library and the flag toolkit
        (``--help`` and a bad flag cost no numpy); ``run`` imports the machinery.
Rule 2: bad input (a measurement file missing, unreadable, of no known format, with a key
        missing or out of range, of another model; a bad config; a table row that cannot
        be reproduced; a fit the measurements cannot determine) is one line,
        ``inference-lab calibrate: error: <file>: <key or line>: <message>``, exit 1; bad
        flags (and a table with measurement files, or neither) exit 2.
Rule 3: the snippet is a ``[hardware.<name>]`` entry for the config: the fitted entry's
        profile, parallelism and scheduler keys, and the fitted terms; it never replaces
        the entry it was fitted from.
Rule 4: measurements that cannot determine the terms are refused before any fit (exit 1):
        fewer distinct measured values (a step's coordinates count once however many
        identical rows repeat them; a load level counts once per metric it measured) than
        terms to fit (identical levels count once too). A fitted term at one of its bounds is named in a note, since the
        measurements may not have determined it.
Rule 5: the table shows every metric's error before and after; an entry worse than the
        one it was fitted from on any metric (by more than :data:`WORSE_BY` points of
        MAPE) is not printed or written without ``--force``: one line naming the metrics,
        exit 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_lab.cli_args import EXIT_OK, EXIT_USAGE, check_output, fail, integer

if TYPE_CHECKING:
    from inference_lab.calibrate.fit import FitResult
    from inference_lab.calibrate.measurements import Measurements
    from inference_lab.core.config import Deployment, ModelConfig

__all__ = ["add_parser", "check_mode", "run", "snippet"]

PROG = "inference-lab calibrate"
#: Rule 5: how many points of MAPE a metric may lose before the entry counts as worse
#: (the table prints tenths).
WORSE_BY = 0.05


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``calibrate`` and its flags on the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        description="Fit the step model's efficiency terms (achievable HBM bandwidth and "
        "FLOP/s fractions, per-step overhead) or time_correction (alpha, beta) of one "
        "deployment to measurements of a real server: inference-lab load -o JSON, aiperf "
        "profile_export_aiperf.json, guidellm benchmarks.json, or a step CSV. Prints the "
        "error per metric before and after and a [hardware.<name>] TOML snippet.",
    )
    parser.add_argument("--config", metavar="PATH|NAME", help="model config")
    parser.add_argument(
        "--hardware",
        metavar="NAME",
        help="the config's [hardware.NAME] entry to start from (default: the config's only "
        "entry, else b200)",
    )
    parser.add_argument(
        "measurements",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="measurement files (load / aiperf / guidellm JSON, or a step CSV)",
    )
    from inference_lab.calibrate.table_cli import add_table_arguments

    add_table_arguments(parser)
    parser.add_argument(
        "--fit",
        default="efficiency",
        metavar="TERMS",
        help="efficiency (memory_bandwidth, flops, step_overhead; the default), "
        "time_correction (alpha, beta), or a comma-separated list of terms: those, "
        "expert_skew, layer_overhead, seq_overhead, frontend_latency, reserved_memory",
    )
    parser.add_argument(
        "--name",
        metavar="ENTRY",
        help="the snippet's entry name (default: <hardware>-calibrated)",
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="PATH", help="write the snippet here (else print it)"
    )
    parser.add_argument(
        "--sim-requests",
        type=integer(ge=1),
        default=1000,
        metavar="N",
        help="at most this many requests per re-simulated load level (default 1000)",
    )
    parser.add_argument(
        "--profiles-dir", metavar="DIR", type=Path, help="hardware profile directory"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="print or write the entry even when it is worse than the one it was fitted "
        "from on some metric",
    )
    return parser


def parse_terms(text: str) -> tuple[str, ...]:
    """``--fit``'s value as parameter names; ValueError naming the bad one."""
    from inference_lab.calibrate.fit import PARAMETERS, PRESETS

    if text in PRESETS:
        return PRESETS[text]
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in PARAMETERS:
            raise ValueError(
                f"--fit: unknown term {n!r} (efficiency, time_correction, or names from "
                f"{', '.join(PARAMETERS)})"
            )
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--fit: needs distinct term names, got {text!r}")
    return names


def check_mode(args: argparse.Namespace) -> bool:
    """Whether the command is the table mode; ValueError for flags that do not go
    together (measurement files with ``--table``, neither, ``--entry`` without it)."""
    if args.table is not None:
        if args.measurements or args.config is not None:
            raise ValueError("--table: fits the table's rows; give no --config or files with it")
        if args.entry is None:
            raise ValueError("--table: needs --entry (the calibrated entry to fit)")
        return True
    if args.entry is not None or args.holdout is not None:
        raise ValueError("--entry and --holdout go with --table")
    if args.config is None or not args.measurements:
        raise ValueError("needs --config and measurement files, or --table and --entry")
    return False


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}" if value != int(value) or abs(value) >= 1e16 else f"{value:.1f}"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def snippet(
    config: ModelConfig, dep: Deployment, result: FitResult, name: str, sources: list[str]
) -> str:
    """Rule 3: the fitted entry as TOML, with the errors before and after as comments."""
    from inference_lab.calibrate.fit import EFFICIENCY_TERMS, PRESETS, mape

    hw = dep.hardware
    before, after = mape(result.before), mape(result.after)
    lines = [
        f"# inference-lab calibrate: {dep.model.name} on {dep.hardware_name} from "
        + ", ".join(sources),
        "# MAPE before -> after: "
        + ", ".join(f"{m} {before[m]:.1f}% -> {after[m]:.1f}%" for m in before),
        f"[hardware.{name}]",
        f"profile = {_toml_value(hw.profile or dep.hardware_name)}",
        f"tp = {hw.tp}",
    ]
    if hw.ep != 1:
        lines.append(f"ep = {hw.ep}")
    if hw.replicas != 1:
        lines.append(f"replicas = {hw.replicas}")
        lines.append(f"router = {_toml_value(hw.router)}")
    sched = {
        k: v for k, v in _fields(dep.scheduler).items() if _fields(config.scheduler).get(k) != v
    }
    if "frontend_latency" in result.fitted:
        sched["frontend_latency"] = result.fitted["frontend_latency"]
    if sched:
        lines.append(f"scheduler = {_toml_value(sched)}")
    fitted = result.fitted
    eff = dep.efficiency
    eff_values = {
        "memory_bandwidth": eff.memory_bandwidth,
        "flops": eff.flops,
        "step_overhead": eff.step_overhead,
    }
    for name in ("expert_skew", "layer_overhead"):
        if name in fitted or getattr(eff, name):
            eff_values[name] = getattr(eff, name)
    eff_values.update({k: v for k, v in fitted.items() if k in EFFICIENCY_TERMS})
    if any(k in fitted for k in EFFICIENCY_TERMS) or hw.efficiency is not None:
        lines.append(f"efficiency = {_toml_value(eff_values)}")
    if (
        {"seq_overhead", "frontend_latency"} & set(fitted)
        or hw.overheads is not None
        or (dep.overheads.frontend_latency)
    ):
        # the scheduler line carries the whole frontend latency (the profile's included)
        overheads = {"seq_overhead": fitted.get("seq_overhead", dep.overheads.seq_overhead)}
        lines.append(f"overheads = {_toml_value({**overheads, 'frontend_latency': 0.0})}")
    tc = {"alpha": hw.time_correction.alpha, "beta": hw.time_correction.beta}
    tc.update({k: v for k, v in fitted.items() if k in PRESETS["time_correction"]})
    if tc != {"alpha": 1.0, "beta": 0.0}:
        lines.append(f"time_correction = {_toml_value(tc)}")
    if hw.step_table is not None:
        lines.append(f"step_table = {_toml_value(hw.step_table)}")
    return "\n".join(lines) + "\n"


def _fields(value: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(value)


def underdetermined(data: Measurements, names: tuple[str, ...]) -> str | None:
    """Rule 4: why ``data`` cannot determine the terms ``names``, or None."""
    steps = {(s.batch_size, s.prefill_tokens, s.context_tokens) for s in data.steps}
    measured = {
        (lv.kind, lv.level, lv.prompt_tokens, lv.output_tokens, lv.start_spread, metric)
        for lv in data.levels
        for metric in lv.measured()
    }
    values = len(steps) + len(measured)
    if values >= len(names):
        return None
    what = []
    if data.steps:
        what.append(f"{len(steps)} distinct step(s) in {len(data.steps)} row(s)")
    if data.levels:
        what.append(f"{len(measured)} distinct measured value(s) of load levels")
    return (
        f"{' and '.join(what)} cannot determine {len(names)} terms ({', '.join(names)}): "
        "the fit is under-determined; measure more batch shapes or levels, or fit fewer "
        "terms (--fit " + ",".join(names[: max(1, values)]) + ")"
    )


def worse_metrics(result: FitResult) -> list[str]:
    """Rule 5: the metrics whose MAPE the fit raised by more than :data:`WORSE_BY`
    points, as ``ttft 12.0% -> 15.1%``."""
    from inference_lab.calibrate.fit import mape

    before, after = mape(result.before), mape(result.after)
    return [
        f"{m} {before[m]:.1f}% -> {after[m]:.1f}%"
        for m in before
        if after.get(m, before[m]) > before[m] + WORSE_BY
    ]


def at_bounds(result: FitResult) -> list[str]:
    """Rule 4: the fitted terms that ended at one of their bounds."""
    from inference_lab.calibrate.fit import PARAMETERS, shown

    out = []
    for name, value in zip(result.names, result.values, strict=True):
        bound = PARAMETERS[name]
        if math.isclose(value, bound.lower, abs_tol=1e-12) or math.isclose(
            value, bound.upper, abs_tol=1e-12
        ):
            edge = "lower" if math.isclose(value, bound.lower, abs_tol=1e-12) else "upper"
            out.append(f"{name} = {shown(name, value)} (its {edge} bound)")
    return out


def format_report(result: FitResult) -> str:
    """The fitted values, and a table of every measured value's error before and after,
    each metric's change marked (Rule 5)."""
    from inference_lab.calibrate.fit import mape, shown

    lines = [
        "fitted     "
        + ", ".join(
            f"{n} {shown(n, v)} (from {shown(n, i)})"
            for n, v, i in zip(result.names, result.values, result.initial, strict=True)
        )
    ]
    lines.append(f"           {result.iterations} iterations, {result.evaluations} evaluations")
    lines.append("")
    lines.append(f"{'metric':<11}{'n':>4}{'MAPE before':>13}{'MAPE after':>12}  change")
    before, after = mape(result.before), mape(result.after)
    for metric in before:
        n = len(result.before.pairs[metric])
        delta = after[metric] - before[metric]
        verdict = "worse" if delta > WORSE_BY else "better" if delta < -WORSE_BY else "same"
        lines.append(
            f"{metric:<11}{n:>4}{before[metric]:>12.1f}%{after[metric]:>11.1f}%  "
            f"{delta:+.1f} points, {verdict}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``calibrate`` command; returns the exit code (Rule 2)."""
    try:
        names = parse_terms(args.fit)
        check_output("-o", args.output)
        table = check_mode(args)
    except ValueError as exc:
        return fail(PROG, str(exc), EXIT_USAGE)
    if table:
        from inference_lab.calibrate.table_cli import run_table

        return run_table(args, names)
    from inference_lab.calibrate.fit import fit
    from inference_lab.calibrate.measurements import read_measurements
    from inference_lab.core.config import load_model_config, select_deployment
    from inference_lab.errors import InferenceLabError
    from inference_lab.resources import default_hardware, resolve_shipped

    try:
        config_path = resolve_shipped(args.config, "config", "--config")
        config = load_model_config(config_path, args.profiles_dir)
        dep = select_deployment(config, args.hardware or default_hardware(config.deployments))
        data = read_measurements(list(args.measurements), dep.model.name)
        print(
            f"calibrate  {dep.model.name} on {dep.hardware_name} ({dep.profile.name} x tp "
            f"{dep.hardware.tp}): {len(data.levels)} load level(s), {len(data.steps)} "
            f"step(s); fitting {', '.join(names)}",
            flush=True,
        )
        why = underdetermined(data, names)
        if why is not None:
            return fail(PROG, why)
        result = fit(dep, data, names, cap=args.sim_requests)
        print(format_report(result))
        for term in at_bounds(result):
            print(f"note: {term}: the measurements may not determine it")
        worse = worse_metrics(result)
        if worse and not getattr(args, "force", False):
            return fail(
                PROG,
                f"the fitted entry is worse than {dep.hardware_name} on {'; '.join(worse)}: "
                "not recommending it (--force prints it anyway)",
            )
        if worse:
            print(f"{PROG}: warning: worse on {'; '.join(worse)} (--force)", file=sys.stderr)
        text = snippet(
            config,
            dep,
            result,
            args.name or f"{dep.hardware_name}-calibrated",
            [str(p) for p in args.measurements],
        )
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
