"""The fidelity table: the simulator's predictions against published measurements.

``docs/fidelity/measurements.csv`` holds rows copied from public vendor tables (each with
its source document, table and row) and a ``split`` column: ``fit`` or ``test``. This
script re-simulates every row on the datasheet entry of its GPU and on the calibrated one,
and writes the table, the out-of-sample errors and the per-row results:

    python scripts/fidelity.py table     # regenerate docs/fidelity.md's table (and results.csv)
    python scripts/fidelity.py fit       # refit the calibrated profiles on the fit rows (writes them)

How a row is reproduced (docs/fidelity.md says why):

- ``offline`` (trtllm-bench throughput): all ``requests`` at t = 0, every prompt ``isl``
  and every output ``osl`` tokens; the engine's batch and token limits are those
  trtllm-bench derives for the model, the GPUs and the lengths
  (tensorrt_llm/bench/build/tuning.py: requests that fit 95 % of the memory left after the
  weights, rounded up to a multiple of 32 / 128 / 256, at most 4096; tokens per step
  max_batch x (1 + isl / osl), at most 32768, rounded up), with 95 % of the memory for the
  weights and KV cache, and no more running requests than the KV cache holds at their
  full length (TensorRT-LLM's default capacity policy, GUARANTEED_NO_EVICT); compared on
  output tokens/s;
- ``closed_loop`` (aiperf against NIM): ``level`` users, each sending its next request when
  the previous one ends; the model config's scheduler; compared on mean TTFT, mean ITL
  (TPOT) and output tokens/s.

Rule: every figure this script writes comes from the shipped data (the CSV, the configs,
the profiles) and the simulator; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_lab.calibrate.fit import (  # noqa: E402
    PRESETS,
    fit_cases,
    mape,
    simulate_level,
)
from inference_lab.calibrate.measurements import (  # noqa: E402
    LoadLevel,
    Measurements,
    start_spread,
)
from inference_lab.core.config import (  # noqa: E402
    BYTES_PER_VALUE,
    AttentionLayer,
    Deployment,
    load_deployment,
    load_hardware_profile,
)
from inference_lab.core.roofline import Roofline  # noqa: E402
from inference_lab.errors import ConfigError  # noqa: E402

DATA = ROOT / "docs" / "fidelity" / "measurements.csv"
RESULTS = ROOT / "docs" / "fidelity" / "results.csv"
PAGE = ROOT / "docs" / "fidelity.md"
PROFILES = ROOT / "hardware_profiles"
BEGIN, END = "<!-- fidelity-table:begin -->", "<!-- fidelity-table:end -->"
CAL_BEGIN, CAL_END = "<!-- calibrated-values:begin -->", "<!-- calibrated-values:end -->"
#: The calibrated entry of each (engine, GPU): the group a row is fitted in.
ENGINE_TAG = {"trtllm-bench": "trtllm", "NIM 1.8.0 (aiperf)": "nim"}
#: What each group fits: throughput-only rows cannot tell a per-step overhead from the
#: bandwidth, so the offline groups fit the two fractions only.
GROUP_TERMS = {"trtllm": ("memory_bandwidth", "flops"), "nim": PRESETS["efficiency"]}
COLUMNS = (
    "id", "source", "table", "row", "column", "engine", "scenario", "model_config", "hardware",
    "tp", "isl", "osl", "level", "requests", "output_tps", "ttft_ms", "tpot_ms", "split",
)  # fmt: skip
#: A closed-loop level is re-simulated with at most this many requests.
SIM_CAP = 1000
#: The fit's iterations at most (each re-simulates every fit row of a group 3-4 times).
FIT_ITERATIONS = 12


@attrs.frozen
class Row:
    path: Path
    line: int
    cells: dict[str, str]

    def __getitem__(self, key: str) -> str:
        return self.cells[key]

    @property
    def group(self) -> str:
        return f"{self['hardware']}-{ENGINE_TAG[self['engine']]}"

    def number(self, key: str) -> float | None:
        text = self.cells[key]
        if text == "":
            return None
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(
                f"{self.path}:{self.line}: {key}: must be a number, got {text!r}"
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{self.path}:{self.line}: {key}: must be > 0, got {text!r}")
        return value


def read_rows(path: Path = DATA) -> list[Row]:
    """The measurement rows; ConfigError (file:line: column: problem) for a bad one."""
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ConfigError(f"{path}:1: the header must be {','.join(COLUMNS)}")
        rows = [Row(path, i, dict(r)) for i, r in enumerate(reader, start=2)]
    for row in rows:
        if row["split"] not in ("fit", "test"):
            raise ConfigError(f"{path}:{row.line}: split: must be fit or test")
        if row["engine"] not in ENGINE_TAG:
            raise ConfigError(f"{path}:{row.line}: engine: must be one of {', '.join(ENGINE_TAG)}")
        if row["scenario"] not in ("offline", "closed_loop"):
            raise ConfigError(f"{path}:{row.line}: scenario: must be offline or closed_loop")
        for key in ("tp", "isl", "osl", "level", "requests", "output_tps", "ttft_ms", "tpot_ms"):
            row.number(key)
    return rows


# ---------------------------------------------------------------------------------------
# reproducing a row


def trtllm_bench_limits(dep: Deployment, isl: int, osl: int) -> tuple[int, int]:
    """The (max batch, max tokens per step) trtllm-bench picks for ``dep`` at ``isl`` /
    ``osl``: the rule of tensorrt_llm/bench/build/tuning.py (calc_engine_setting,
    finetune_setting), in GiB as it counts, with KV at the model's KV precision."""
    model, tp = dep.model, dep.hardware.tp
    gib = 1024**3
    params = sum(w.resident_params for w in model.weights)
    quantised = [w for w in model.weights if w.precision != "bf16"]
    per_param = BYTES_PER_VALUE[quantised[0].precision] if quantised else 2.0
    attention = [x for x in model.layers if isinstance(x, AttentionLayer)]
    per_token = (
        sum(
            2 * x.count * max(tp, x.kv_heads) * x.head_dim * BYTES_PER_VALUE[x.kv_precision]
            for x in attention
        )
        / gib
    )
    available = dep.profile.memory_capacity * tp / gib - params * per_param / gib
    requests = available * 0.95 / (per_token * (isl + osl))
    raw_batch = min(requests, 4096)
    if raw_batch < 256:
        batch = max(64, 32 * math.ceil(raw_batch / 32))
    elif raw_batch < 1024:
        batch = 128 * math.ceil(raw_batch / 128)
    else:
        batch = 256 * math.ceil(raw_batch / 256)
    raw_tokens = min(raw_batch * (1 + isl / osl), 32768)
    if raw_tokens < 4096:
        tokens = max(2048, 256 * math.ceil(raw_tokens / 256))
    elif raw_tokens < 8192:
        tokens = 512 * math.ceil(raw_tokens / 512)
    else:
        tokens = 1024 * math.ceil(raw_tokens / 1024)
    return batch, tokens


def row_case(row: Row, hardware: str) -> tuple[Deployment, LoadLevel]:
    """The deployment and the load level that reproduce ``row`` on the entry ``hardware``
    of its model config."""
    path = ROOT / "configs" / "fidelity" / f"{row['model_config']}.toml"
    dep = load_deployment(path, hardware, PROFILES)
    isl, osl = round(row.number("isl") or 0), round(row.number("osl") or 0)
    level_value = row.number("level") or 0
    if row["scenario"] == "offline":
        batch, tokens = trtllm_bench_limits(dep, isl, osl)
        sched = attrs.evolve(
            dep.scheduler, max_num_batched_tokens=tokens, gpu_memory_utilization=0.95
        )
        dep = attrs.evolve(dep, scheduler=sched)
        # TensorRT-LLM's default capacity policy, GUARANTEED_NO_EVICT, admits a request
        # only when its whole length fits the KV cache: at most this many at once
        seats = dep.total_blocks // Roofline(dep).blocks_for(isl + osl)
        sched = attrs.evolve(sched, max_num_seqs=max(1, min(batch, seats)))
        dep = attrs.evolve(dep, scheduler=sched)
        kind = "batched"
    else:
        kind = "closed"
    level = LoadLevel(
        source=f"{row.path}:{row.line}",
        kind=kind,
        level=level_value,
        prompt_tokens=isl,
        output_tokens=osl,
        ttft=None if row.number("ttft_ms") is None else (row.number("ttft_ms") or 0) / 1e3,
        tpot=None if row.number("tpot_ms") is None else (row.number("tpot_ms") or 0) / 1e3,
        throughput=row.number("output_tps"),
    )
    return dep, start_spread(level)


def _simulate(args: tuple[Row, str]) -> tuple[str, str, dict[str, float], float]:
    row, hardware = args
    start = time.process_time()
    dep, level = row_case(row, hardware)
    return row["id"], hardware, simulate_level(dep, level, SIM_CAP), time.process_time() - start


def simulate_all(
    jobs: list[tuple[Row, str]], workers: int
) -> Iterator[tuple[str, str, dict[str, float], float]]:
    if workers <= 1:
        yield from map(_simulate, jobs)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(_simulate, jobs)


# ---------------------------------------------------------------------------------------
# the table


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def _err(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None:
        return "–"
    return f"{100 * (predicted - measured) / measured:+.1f} %"


METRIC_KEYS = (
    ("throughput", "output_tps", 1.0),
    ("tpot", "tpot_ms", 1e3),
    ("ttft", "ttft_ms", 1e3),
)


def table(workers: int) -> None:
    rows = read_rows()
    jobs = [(row, entry) for row in rows for entry in (row["hardware"], row.group)]
    results: dict[tuple[str, str], dict[str, float]] = {}
    cpu = 0.0
    for i, (rid, hardware, predicted, seconds) in enumerate(simulate_all(jobs, workers), 1):
        results[(rid, hardware)] = predicted
        cpu += seconds
        print(f"[{i}/{len(jobs)}] {rid} on {hardware}: {seconds:.1f} s", file=sys.stderr)
    # results.csv: every row, both entries
    with RESULTS.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "split", "entry", "metric", "measured", "predicted", "error_pct"])
        for row in rows:
            for entry in (row["hardware"], row.group):
                predicted = results[(row["id"], entry)]
                for metric, column, unit in METRIC_KEYS:
                    measured = row.number(column)
                    if measured is None or metric not in predicted:
                        continue
                    value = predicted[metric] * unit
                    writer.writerow(
                        [row["id"], row["split"], entry, metric, measured, f"{value:.6g}",
                         f"{100 * (value - measured) / measured:.2f}"]
                    )  # fmt: skip
    page = _splice(PAGE.read_text(encoding="utf-8"), render(rows, results), BEGIN, END)
    page = _splice(page, render_calibrated(rows), CAL_BEGIN, CAL_END)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {RESULTS.relative_to(ROOT)} and the table of {PAGE.relative_to(ROOT)} "
          f"({len(jobs)} simulations, {cpu:.0f} s CPU)")  # fmt: skip


def _mape(rows: list[Row], results: dict[tuple[str, str], dict[str, float]], split: str,
          calibrated: bool, metric: str, column: str, unit: float) -> tuple[float | None, int]:  # fmt: skip
    errors = []
    for row in rows:
        measured = row.number(column)
        if row["split"] != split or measured is None:
            continue
        entry = row.group if calibrated else row["hardware"]
        predicted = results[(row["id"], entry)].get(metric)
        if predicted is not None:
            errors.append(abs(predicted * unit - measured) / measured)
    return (100 * sum(errors) / len(errors), len(errors)) if errors else (None, 0)


def render(rows: list[Row], results: dict[tuple[str, str], dict[str, float]]) -> str:
    out = [
        "MAPE per metric (rows: how many rows carry the metric). *Out of sample* is the test "
        "half, which the calibration never saw.",
        "",
        "| metric | split | rows | datasheet roofline | calibrated |",
        "|---|---|---|---|---|",
    ]
    names = {"throughput": "output tokens/s", "tpot": "TPOT (ITL)", "ttft": "TTFT"}
    for metric, column, unit in METRIC_KEYS:
        for split in ("test", "fit"):
            raw, n = _mape(rows, results, split, False, metric, column, unit)
            cal, _ = _mape(rows, results, split, True, metric, column, unit)
            if n:
                label = "**test (out of sample)**" if split == "test" else "fit"
                out.append(
                    f"| {names[metric]} | {label} | {n} | {_fmt(raw, 1)} % | {_fmt(cal, 1)} % |"
                )
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(f"{row['engine']}|{row['table']}|{row['column']}", []).append(row)
    for key, members in groups.items():
        engine, table_name, column = key.split("|")
        first = members[0]
        out += ["", f"**{table_name}**, {column} ({engine}; `{first['model_config']}`, "
                f"entries `{first['hardware']}` / `{first.group}`)", ""]  # fmt: skip
        if first["scenario"] == "offline":
            out += [
                "| row | split | measured tok/s | datasheet | error | calibrated | error |",
                "|---|---|---|---|---|---|---|",
            ]
            for row in members:
                m = row.number("output_tps")
                raw = results[(row["id"], row["hardware"])]["throughput"]
                cal = results[(row["id"], row.group)]["throughput"]
                out.append(
                    f"| {row['row']} | {row['split']} | {_fmt(m)} | {_fmt(raw)} | {_err(raw, m)} "
                    f"| {_fmt(cal)} | {_err(cal, m)} |"
                )
        else:
            out += [
                "| row | split | measured TTFT / ITL / tok/s | datasheet | errors | calibrated "
                "| errors |",
                "|---|---|---|---|---|---|---|",
            ]
            for row in members:
                meas = [row.number(c) for _, c, _ in METRIC_KEYS[::-1]]
                cells = []
                for entry in (row["hardware"], row.group):
                    p = results[(row["id"], entry)]
                    pred = [p.get(m, math.nan) * u for m, _, u in METRIC_KEYS[::-1]]
                    cells.append(" / ".join(_fmt(v, 1) for v in pred))
                    cells.append(" / ".join(_err(v, w) for v, w in zip(pred, meas, strict=True)))
                measured = " / ".join(_fmt(v, 1) for v in meas)
                out.append(
                    f"| {row['row']} | {row['split']} | {measured} | " + " | ".join(cells) + " |"
                )
    return "\n".join(out)


def _splice(page: str, body: str, begin: str, end: str) -> str:
    if begin not in page or end not in page:
        raise ConfigError(f"{PAGE}: the markers {begin} and {end} are missing")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_calibrated(rows: list[Row]) -> str:
    """The calibrated entries' table: what each was fitted on and its shipped values."""
    out = [
        "| entry | fitted on | terms fitted | memory_bandwidth | flops | step_overhead |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    for group, members in groups.items():
        eff = load_hardware_profile(PROFILES / f"{group}.toml").efficiency
        fit_rows = [r for r in members if r["split"] == "fit"]
        models = sorted({r["model_config"] for r in members})
        terms = ", ".join(GROUP_TERMS[group.rsplit("-", 1)[1]])
        out.append(
            f"| `{group}` | {len(fit_rows)} fit rows: {members[0]['engine']}, {', '.join(models)} "
            f"| {terms} | {eff.memory_bandwidth:.3g} | {eff.flops:.3g} "
            f"| {eff.step_overhead * 1e3:.3g} ms |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# the fit


def fit_groups(workers: int, only: list[str] | None) -> None:
    """Fit each calibrated group (or those of ``only``) on its fit rows and write the
    values to its profile."""
    rows = read_rows()
    groups: dict[str, list[Row]] = {}
    for row in rows:
        if row["split"] == "fit" and (not only or row.group in only):
            groups.setdefault(row.group, []).append(row)
    for group, members in groups.items():
        terms = GROUP_TERMS[group.rsplit("-", 1)[1]]
        cases = []
        for row in members:
            dep, level = row_case(row, row["hardware"])
            cases.append((dep, Measurements(levels=(level,))))
        start = time.monotonic()
        with ProcessPoolExecutor(workers) as pool:
            evaluations = 0

            def mapper(func: Any, jobs: list[Any], _map: Any = pool.map, _g: str = group) -> Any:
                nonlocal evaluations
                evaluations += 1
                print(f"  {_g}: evaluation {evaluations}", file=sys.stderr, flush=True)
                return list(_map(func, jobs))

            result = fit_cases(cases, terms, SIM_CAP, mapper, max_iterations=FIT_ITERATIONS)
        before, after = mape(result.before), mape(result.after)
        print(
            f"{group}: {len(members)} fit rows; "
            + ", ".join(f"{n} = {v:.4g}" for n, v in result.fitted.items())
            + "; MAPE on the fit rows "
            + ", ".join(f"{m} {before[m]:.1f} % -> {after[m]:.1f} %" for m in before)
            + f" ({result.iterations} iterations, {result.evaluations} evaluations, "
            f"{time.monotonic() - start:.0f} s)",
            flush=True,
        )
        write_efficiency(group, result.fitted)


def write_efficiency(group: str, fitted: dict[str, float]) -> None:
    """Set the fitted keys of the ``[efficiency]`` table of ``hardware_profiles/<group>.toml``
    (the rest of the file, its comments included, is kept)."""
    path = PROFILES / f"{group}.toml"
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index("[efficiency]")
    for name, value in fitted.items():
        for i in range(start + 1, len(lines)):
            if lines[i].split("=")[0].strip() == name:
                lines[i] = f"{name} = {value:.4g}"
                break
        else:
            raise ConfigError(f"{path}: efficiency.{name}: no such line to set")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    check = load_hardware_profile(path)
    print(f"  wrote {path.relative_to(ROOT)}: {check.efficiency}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("table", "fit"))
    parser.add_argument(
        "--workers", type=int, default=2, help="simulations in parallel (default 2)"
    )
    parser.add_argument(
        "--group", action="append", help="fit: only this calibrated entry (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "table":
            table(args.workers)
        else:
            fit_groups(args.workers, args.group)
    except ConfigError as exc:
        print(f"fidelity: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
