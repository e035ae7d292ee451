"""The fidelity table: the simulator's predictions against published measurements.

``docs/fidelity/measurements.csv`` holds rows copied from public tables (each with its
source document, table and row; the columns are inference_lab/calibrate/table.py's). Each
row names the calibrated entry of its GPU and engine (``h100-vllm``, ``h200-sglang``, ...);
this script re-simulates every row on the datasheet roofline of its GPU, on the calibrated
entry, and out of sample, and writes the tables of docs/fidelity.md, the per-row results
and the predicted-vs-measured plot:

    python scripts/fidelity.py fit       # refit the calibrated profiles (writes them)
    python scripts/fidelity.py holdout   # the out-of-sample folds (writes holdout.csv)
    python scripts/fidelity.py table     # docs/fidelity.md's tables, results.csv, fidelity.png

Out of sample (docs/fidelity.md says why): an entry with ``test`` rows of a model its
``fit`` rows also have keeps that split (the shipped values are fitted on its ``fit`` rows,
its ``test`` rows are out of sample); the others are held out by whole model where their
fit rows cover two models or more (each model predicted by the terms fitted on the
others), else by whole load range where they cover one model at several concurrencies
(each half of the levels predicted from the other). A ``test`` row of a model no fit row
has is out of sample on the shipped values themselves. Those rules, the terms each entry
fits and the paths are ``fidelity_entries.py``'s; the fit, the hold-out, the simulations
and the tables are this script's.

Rule: every figure this script writes comes from the shipped data (the CSV, the configs,
the profiles) and the simulator; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Sequence

import attrs

# first: it puts the checkout's root on the path for inference_lab (and names it ROOT)
from fidelity_entries import (
    DATA,
    DATASHEET,
    FIT_ITERATIONS,
    HOLDOUT,
    HOLDOUT_COLUMNS,
    HOST_TERMS,
    INHERITS,
    METRICS,
    PAGE,
    PLOT,
    PROFILES,
    RESULTS,
    ROOT,
    SIM_CAP,
    TERMS,
    engine_tag,
    entry_cases,
    holdout_kind,
    holdout_lines,
    inherited,
    mapper,
    out_of_sample,
    read_holdout,
    read_rows,
    terms_of,
    terms_text,
)

from inference_lab.calibrate.fit import apply, is_missing, mape, simulate_level
from inference_lab.calibrate.table import Case, datasheet_case, trtllm_bench_limits
from inference_lab.calibrate.tablefit import fit_entry, holdout
from inference_lab.core.config import load_hardware_profile
from inference_lab.errors import InferenceLabError

#: Where the generated tables go in docs/fidelity.md.
BEGIN, END = "<!-- fidelity-table:begin -->", "<!-- fidelity-table:end -->"
CAL_BEGIN, CAL_END = "<!-- calibrated-values:begin -->", "<!-- calibrated-values:end -->"

#: Read by the tests beside this script's own functions (fidelity_entries holds them).
__all__ = [
    "DATA",
    "HOST_TERMS",
    "INHERITS",
    "TERMS",
    "engine_tag",
    "entry_cases",
    "holdout_kind",
    "inherited",
    "read_rows",
    "trtllm_bench_limits",
]

# ---------------------------------------------------------------------------------------
# the fit


def fit_entries(workers: int, only: list[str] | None) -> None:
    """Fit each calibrated entry (or those of ``only``) and write its profile."""
    groups = entry_cases(read_rows())
    for entry, cases in groups.items():
        if only and entry not in only:
            continue
        terms = terms_of(entry)
        start_at = {**inherited(entry), **{n: DATASHEET[n] for n in terms}}
        fit_on = [
            attrs.evolve(c, deployment=apply(c.deployment, start_at))
            for c in cases
            if c.row["split"] == "fit"
        ]
        start = time.monotonic()
        with mapper(workers) as run:
            result = fit_entry(fit_on, terms, SIM_CAP, run, FIT_ITERATIONS)
        before, after = mape(result.before), mape(result.after)
        print(
            f"{entry}: {len(fit_on)} fit rows; "
            + ", ".join(f"{n} = {v:.4g}" for n, v in result.fitted.items())
            + "; MAPE "
            + ", ".join(f"{m} {before[m]:.1f} % -> {after[m]:.1f} %" for m in before)
            + f" ({result.iterations} iterations, {result.evaluations} evaluations, "
            f"{time.monotonic() - start:.0f} s)",
            flush=True,
        )
        write_profile(entry, {**inherited(entry), **result.fitted})


def write_profile(entry: str, fitted: dict[str, float]) -> None:
    """Set the fitted keys in ``hardware_profiles/<entry>.toml``: ``[efficiency]``'s, and
    ``[overheads]``'s (the table added at the end when the profile has none); the rest of the
    file, its comments included, is kept."""
    path = PROFILES / f"{entry}.toml"
    lines = path.read_text(encoding="utf-8").splitlines()
    for name, value in fitted.items():
        over = name in ("seq_overhead", "frontend_latency", "reserved_memory")
        table = "[overheads]" if over else "[efficiency]"
        if table not in lines:
            lines += ["", table]
        start = lines.index(table)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines)
        )
        for i in range(start + 1, end):
            if lines[i].split("=")[0].strip() == name:
                lines[i] = f"{name} = {value:.4g}"
                break
        else:
            at = end
            while at > start + 1 and not lines[at - 1].strip():
                at -= 1
            lines.insert(at, f"{name} = {value:.4g}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    check = load_hardware_profile(path)
    print(f"  wrote {path.relative_to(ROOT)}: {check.efficiency}, {check.overheads}")


# ---------------------------------------------------------------------------------------
# the table


def _simulate(case: Case) -> dict[str, float]:
    return simulate_level(case.deployment, case.level, SIM_CAP)


def predictions(workers: int) -> tuple[list[Case], dict[str, dict[str, dict[str, float]]]]:
    """Every row's predictions: ``datasheet``, ``calibrated`` (simulated here) and ``held
    out`` (read from HOLDOUT), by row id."""
    groups = entry_cases(read_rows())
    cases = [c for members in groups.values() for c in members]
    out: dict[str, dict[str, dict[str, float]]] = {c.row["id"]: {} for c in cases}
    sheets = [datasheet_case(c, PROFILES) for c in cases]
    with mapper(workers) as run:
        runnable = [s for s in sheets if s is not None]
        for sheet, got in zip(runnable, run(_simulate, runnable), strict=True):
            out[sheet.row["id"]]["datasheet"] = got
        for case, got in zip(cases, run(_simulate, cases), strict=True):
            out[case.row["id"]]["calibrated"] = got
    held, unfitted = read_holdout()
    for entry, members in groups.items():
        if holdout_kind(members) in ("model", "concurrency"):
            fitted = [c for c in members if c.row["split"] == "fit"]
            missing = [c.row["id"] for c in fitted if c.row["id"] not in {**held, **unfitted}]
            if missing:
                raise InferenceLabError(
                    f"{HOLDOUT}: no held-out prediction of {', '.join(missing[:3])}: run "
                    f"`python scripts/fidelity.py holdout --entry {entry}` first"
                )
        for case in members:
            if case.row["id"] in held:
                out[case.row["id"]]["held out"] = held[case.row["id"]]
    return cases, out


def holdout_entries(workers: int, only: list[str] | None) -> None:
    """Each entry held out by model or by load range (or those of ``only``): the folds
    fitted from the datasheet, their held-out rows' predictions written to HOLDOUT (the
    other entries' lines kept)."""
    groups = entry_cases(read_rows())
    kept = [line for line in holdout_lines() if not only or line["entry"] not in only]
    lines = list(kept)
    for entry, cases in groups.items():
        kind = holdout_kind(cases)
        if (only and entry not in only) or kind not in ("model", "concurrency"):
            continue
        terms = terms_of(entry)
        start_at = {**inherited(entry), **{n: DATASHEET[n] for n in terms}}
        cases = [
            attrs.evolve(c, deployment=apply(c.deployment, start_at))
            for c in cases
            if c.row["split"] == "fit"
        ]
        start = time.monotonic()
        with mapper(workers) as run:
            folds = holdout(cases, terms, kind, SIM_CAP, run, FIT_ITERATIONS)
        for fold in folds:
            fitted = "; ".join(f"{n} = {v:.4g}" for n, v in fold.values.items())
            if fold.unfitted:
                for case in fold.tested_on:
                    lines.append({
                        "entry": entry, "id": case.row["id"], "held_out": f"{kind}: {fold.held_out}",
                        "metric": "", "predicted": "", "fitted": f"not fitted: {fold.unfitted}",
                    })  # fmt: skip
                continue
            for case, prediction in zip(fold.tested_on, fold.predictions, strict=True):
                for metric, [(p, measured)] in prediction.pairs.items():
                    lines.append({
                        "entry": entry, "id": case.row["id"], "held_out": f"{kind}: {fold.held_out}",
                        "metric": metric, "predicted": "" if is_missing(p, measured) else f"{p:.6g}",
                        "fitted": fitted,
                    })  # fmt: skip
        print(
            f"{entry}: held out by {kind}, {len(folds)} folds ({time.monotonic() - start:.0f} s)",
            flush=True,
        )
        write_holdout(lines)
    write_holdout(lines)


def write_holdout(lines: list[dict[str, str]]) -> None:
    with HOLDOUT.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=HOLDOUT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(lines)


def table(workers: int) -> None:
    cases, got = predictions(workers)
    write_results(cases, got)
    page = _splice(PAGE.read_text(encoding="utf-8"), render(cases, got), BEGIN, END)
    page = _splice(page, render_calibrated(cases), CAL_BEGIN, CAL_END)
    PAGE.write_text(page, encoding="utf-8")
    plot(cases, got)
    print(f"wrote {RESULTS.relative_to(ROOT)}, {PLOT.relative_to(ROOT)} and the tables of "
          f"{PAGE.relative_to(ROOT)}")  # fmt: skip


def write_results(cases: Sequence[Case], got: dict[str, dict[str, dict[str, float]]]) -> None:
    with RESULTS.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(
            ["id", "entry", "split", "prediction", "metric", "measured", "predicted", "error_pct"]
        )
        for case in cases:
            rid = case.row["id"]
            measured = case.row.measured()
            kinds = [
                ("datasheet", got[rid].get("datasheet")),
                ("calibrated", got[rid].get("calibrated")),
            ]
            kinds.append(("out of sample", out_of_sample(case, got[rid])))
            for kind, predicted in kinds:
                if predicted is None:
                    continue
                for metric, _, unit in METRICS:
                    if metric not in measured or metric not in predicted:
                        continue
                    m, p = measured[metric] * unit, predicted[metric] * unit
                    writer.writerow([rid, case.row["entry"], case.row["split"], kind, metric,
                                     f"{m:.6g}", f"{p:.6g}", f"{100 * (p - m) / m:.2f}"])  # fmt: skip


# ---------------------------------------------------------------------------------------
# rendering


def _err(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None:
        return "–"
    return f"{100 * (predicted - measured) / measured:+.1f} %"


def _mape(pairs: list[tuple[float, float]]) -> str:
    if not pairs:
        return "–"
    return f"{100 * sum(abs(p - m) / m for p, m in pairs) / len(pairs):.1f} %"


def _pairs(
    cases: Sequence[Case], got: dict[str, dict[str, dict[str, float]]], kind: str, metric: str
) -> list[tuple[float, float]]:
    out = []
    for case in cases:
        measured = case.row.measured().get(metric)
        g = got[case.row["id"]]
        predicted = out_of_sample(case, g) if kind == "out of sample" else g.get(kind)
        if measured is not None and predicted is not None and metric in predicted:
            out.append((predicted[metric], measured))
    return out


def render(cases: Sequence[Case], got: dict[str, dict[str, dict[str, float]]]) -> str:
    out = [
        "MAPE per calibrated entry (engine x GPU) and metric. *Out of sample*: held out by "
        "whole model where the entry covers two models or more, by whole load range where it "
        "covers one model at several concurrencies, else the CSV's test rows; *calibrated*: "
        "the shipped values on every row (in sample where they were fitted on it).",
        "",
        "| entry | models | held out by | metric | rows | datasheet | calibrated | **out of sample** |",
        "|---|---|---|---|---|---|---|---|",
    ]
    entries: dict[str, list[Case]] = {}
    for case in cases:
        entries.setdefault(case.row["entry"], []).append(case)
    for entry, members in entries.items():
        models = sorted({c.row["model_config"] for c in members})
        kind = holdout_kind(members)
        for metric, name, _ in METRICS:
            sample = _pairs(members, got, "calibrated", metric)
            if not sample:
                continue
            out.append(
                f"| `{entry}` | {', '.join(models)} | {kind} | {name} | {len(sample)} "
                f"| {_mape(_pairs(members, got, 'datasheet', metric))} | {_mape(sample)} "
                f"| **{_mape(_pairs(members, got, 'out of sample', metric))}** |"
            )
    out += ["", "Out of sample per model (MAPE):", "",
            "| entry | model | rows | TTFT | TPOT | median ITL | output tokens/s |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for entry, members in entries.items():
        for model in sorted({c.row["model_config"] for c in members}):
            mine = [c for c in members if c.row["model_config"] == model]
            cells = [
                _mape(_pairs(mine, got, "out of sample", m))
                for m in ("ttft", "tpot", "itl", "throughput")
            ]
            out.append(f"| `{entry}` | {model} | {len(mine)} | " + " | ".join(cells) + " |")
    out += render_rows(cases, got)
    return "\n".join(out)


def render_rows(cases: Sequence[Case], got: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """One table per source table: each row measured, on the datasheet, calibrated and out
    of sample, with the errors."""
    out: list[str] = []
    tables: dict[str, list[Case]] = {}
    for case in cases:
        key = f"{case.row['engine']}|{case.row['table']}|{case.row['column']}|{case.row['entry']}"
        tables.setdefault(key, []).append(case)
    for key, members in tables.items():
        engine, table_name, column, entry = key.split("|")
        first = members[0].row
        metrics = [m for m in METRICS if any(m[0] in c.row.measured() for c in members)]
        label = " / ".join(name for _, name, _ in metrics[::-1])
        out += ["", f"**{table_name}**, {column} ({engine}; `{first['model_config']}`, "
                f"`{first['hardware']}` datasheet / `{entry}`)", "",
                f"| row | split | measured {label} | datasheet | calibrated | out of sample | errors (datasheet; calibrated; out of sample) |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for case in members:
            meas = case.row.measured()
            g = got[case.row["id"]]
            preds = [g.get("datasheet"), g.get("calibrated"), out_of_sample(case, g)]
            cells = [" / ".join(_num(meas.get(m), u) for m, _, u in metrics[::-1])]
            errors = []
            for i, p in enumerate(preds):
                if p is None and i == 0:
                    cells.append("does not fit")
                    errors.append("does not fit the datasheet's memory")
                    continue
                if p == {}:
                    cells.append("did not run")
                    errors.append("did not run")
                    continue
                cells.append(
                    "–" if p is None else " / ".join(_num(p.get(m), u) for m, _, u in metrics[::-1])
                )
                errors.append(
                    "–"
                    if p is None
                    else " / ".join(_err(p.get(m), meas.get(m)) for m, _, _ in metrics[::-1])
                )
            out.append(
                f"| {case.row['row']} | {case.row['split']} | "
                + " | ".join(cells)
                + f" | {'; '.join(errors)} |"
            )
    return out


def _num(value: float | None, unit: float) -> str:
    if value is None:
        return "–"
    v = value * unit
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _splice(page: str, body: str, begin: str, end: str) -> str:
    if begin not in page or end not in page:
        raise InferenceLabError(f"{PAGE}: the markers {begin} and {end} are missing")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_calibrated(cases: Sequence[Case]) -> str:
    """The calibrated entries: what each was fitted on and its shipped values."""
    out = [
        "| entry | fitted on | terms fitted | memory_bandwidth | flops | step_overhead | layer_overhead | expert_skew | seq_overhead | frontend_latency | reserved_memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    entries: dict[str, list[Case]] = {}
    for case in cases:
        entries.setdefault(case.row["entry"], []).append(case)
    for entry, members in entries.items():
        profile = load_hardware_profile(PROFILES / f"{entry}.toml")
        eff, over = profile.efficiency, profile.overheads
        fit_rows = [c for c in members if c.row["split"] == "fit"]
        models = sorted({c.row["model_config"] for c in members})
        out.append(
            f"| `{entry}` | {len(fit_rows)} rows: {members[0].row['engine']}, {', '.join(models)} "
            f"| {terms_text(entry)} | {eff.memory_bandwidth:.3g} | {eff.flops:.3g} "
            f"| {eff.step_overhead * 1e3:.3g} ms | {eff.layer_overhead * 1e6:.3g} µs "
            f"| {eff.expert_skew:.3g} "
            f"| {over.seq_overhead * 1e6:.3g} µs "
            f"| {over.frontend_latency * 1e3:.3g} ms | {over.reserved_memory / 1e9:.3g} GB |"
        )
    return "\n".join(out)


def plot(cases: Sequence[Case], got: dict[str, dict[str, dict[str, float]]]) -> None:
    """Predicted (out of sample where there is such a prediction, else calibrated) against
    measured TTFT and TPOT, log-log, one colour per engine, with the y = x line and the
    goal bands (25 % TTFT, 15 % TPOT)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted({c.row["engine"] for c in cases})
    colours = dict(zip(engines, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, (metric, name, band) in zip(
        axes, (("ttft", "TTFT", 0.25), ("tpot", "TPOT", 0.15)), strict=True
    ):
        lo, hi = float("inf"), 0.0
        for engine in engines:
            xs, ys = [], []
            for case in cases:
                if case.row["engine"] != engine or metric not in case.row.measured():
                    continue
                g = got[case.row["id"]]
                predicted = out_of_sample(case, g)
                if predicted is None:
                    predicted = g.get("calibrated")
                if predicted is None or metric not in predicted:
                    continue
                xs.append(case.row.measured()[metric] * 1e3)
                ys.append(predicted[metric] * 1e3)
            if xs:
                ax.scatter(xs, ys, s=18, color=colours[engine], label=engine, alpha=0.8)
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        if hi > 0:
            line = [lo / 1.5, hi * 1.5]
            ax.plot(line, line, color="black", linewidth=0.8)
            ax.fill_between(
                line,
                [v * (1 - band) for v in line],
                [v * (1 + band) for v in line],
                color="grey",
                alpha=0.15,
                label=f"±{band:.0%}",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {name} (ms)")
        ax.set_ylabel(f"predicted {name} (ms)")
        ax.set_title(f"{name}: out of sample where held out, else calibrated")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("table", "fit", "holdout"))
    parser.add_argument(
        "--workers", type=int, default=2, help="simulations in parallel (default 2)"
    )
    parser.add_argument(
        "--entry", action="append", help="fit, holdout: only this calibrated entry (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "table":
            table(args.workers)
        elif args.command == "holdout":
            holdout_entries(args.workers, args.entry)
        else:
            fit_entries(args.workers, args.entry)
    except InferenceLabError as exc:
        print(f"fidelity: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
