"""The calibrated entries of the fidelity table (``scripts/fidelity.py``'s data and rules):
where the measurements, the profiles and the outputs live, the terms each entry fits and
those it takes from another entry, how each entry is measured out of sample, and the
held-out predictions ``holdout`` writes, read back. What is fitted, simulated and drawn
is ``fidelity.py``'s."""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402

from inference_lab.calibrate.table import (  # noqa: E402
    Case,
    TableRow,
    check_units,
    config_finder,
    read_table,
    row_cases,
)
from inference_lab.core.config import load_hardware_profile  # noqa: E402

DATA = ROOT / "docs" / "fidelity" / "measurements.csv"
RESULTS = ROOT / "docs" / "fidelity" / "results.csv"
HOLDOUT = ROOT / "docs" / "fidelity" / "holdout.csv"
PLOT = ROOT / "docs" / "fidelity.png"
PAGE = ROOT / "docs" / "fidelity.md"
PROFILES = ROOT / "hardware_profiles"
CONFIG_DIRS = (ROOT / "configs" / "fidelity", ROOT / "configs" / "frontier", ROOT / "configs")
#: What each calibrated entry fits, by its engine tag (the entry's name after the GPU's):
#: throughput-only tables cannot tell a per-step overhead from the bandwidth; vLLM's
#: bursts of 100-1,000 requests pin the host's per-sequence work, and models of different
#: depths its time per layer (the memory vLLM keeps out of its KV cache is not fitted: the
#: profiles compute it as vLLM does, with [overheads] weight_scales, expert_*_multiple and
#: profile_run); SGLang's closed loops at 4-64 users (the KV cache never full) its
#: per-request latency in front of the engine.
TERMS = {
    "trtllm": ("memory_bandwidth", "flops"),
    "nim": ("memory_bandwidth", "flops", "step_overhead"),
    "vllm": (
        "memory_bandwidth",
        "flops",
        "step_overhead",
        "seq_overhead",
        "expert_skew",
        "layer_overhead",
    ),
    "sglang": ("memory_bandwidth", "flops", "step_overhead", "frontend_latency"),
}
#: Entries whose rows determine fewer terms than their engine's (beside those INHERITS
#: gives them): h200-vllm's two models fit the GPU's bandwidth and FLOP fractions;
#: b200-vllm's one (two closed loops of GLM-4.6-FP8 at tp 8, both bound by the same decode
#: step) its FLOP fraction and a time per step, the Blackwell kernels' own.
ENTRY_TERMS = {
    "h200-vllm": ("memory_bandwidth", "flops"),
    "b200-vllm": ("flops", "step_overhead"),
}
#: Entries that take the host's terms (the engine's work per sequence and per layer in a
#: step, and its router's skew) from another entry of the same engine, and fit only the
#: GPU's own: h200-vllm's rows (two TP-8 MoE models of 61 and 92 layers) and b200-vllm's
#: (one) cannot tell the time per layer from the time per step nor the per-sequence work
#: from the bandwidth; h100-vllm's five models of 24-92 layers at tp 1 and 8 can.
HOST_TERMS = ("seq_overhead", "expert_skew", "layer_overhead")
INHERITS = {"h200-vllm": ("h100-vllm", HOST_TERMS), "b200-vllm": ("h100-vllm", HOST_TERMS)}
#: Where every fit starts: the datasheet (no efficiency or host terms).
DATASHEET = {
    "memory_bandwidth": 1.0,
    "flops": 1.0,
    "step_overhead": 0.0,
    "expert_skew": 0.0,
    "layer_overhead": 0.0,
    "seq_overhead": 0.0,
    "frontend_latency": 0.0,
    "reserved_memory": 0.0,
}
#: A closed-loop level is re-simulated with at most this many requests (or 4 per user).
SIM_CAP = 200
#: The fit's iterations at most (each re-simulates every row of an entry 3-5 times).
FIT_ITERATIONS = 12
METRICS = (
    ("throughput", "output tokens/s", 1.0),
    ("itl", "median ITL", 1e3),
    ("tpot", "TPOT", 1e3),
    ("ttft", "TTFT", 1e3),
)


def read_rows(path: Path = DATA) -> list[TableRow]:
    """The measurement rows (inference_lab.calibrate.table.read_table: file:line: column:
    problem for a bad one)."""
    return read_table(path)


def engine_tag(entry: str) -> str:
    return entry.rsplit("-", 1)[1]


def terms_of(entry: str) -> tuple[str, ...]:
    """The terms ``entry`` is fitted on (its engine's, unless ENTRY_TERMS says fewer)."""
    return ENTRY_TERMS.get(entry, TERMS[engine_tag(entry)])


@contextmanager
def mapper(workers: int) -> Iterator[Callable[[Any, list[Any]], list[Any]]]:
    if workers <= 1:
        yield lambda func, jobs: list(map(func, jobs))
        return
    with ProcessPoolExecutor(workers) as pool:
        yield lambda func, jobs: list(pool.map(func, jobs))


def entry_cases(rows: Sequence[TableRow]) -> dict[str, list[Case]]:
    """Every row as a case on its calibrated entry (checked), grouped by entry."""
    cases = row_cases(rows, config_finder(CONFIG_DIRS), PROFILES)
    for case in cases:
        check_units(case)
    groups: dict[str, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.row["entry"], []).append(case)
    return groups


def holdout_kind(cases: Sequence[Case]) -> str:
    """How an entry is measured out of sample (the module docstring): by the CSV's split
    where a test row is of a model the fit rows have (the shipped values are fitted on the
    others), else by whole model among the fit rows, else by whole load range. Test rows
    of a model no fit row has are out of sample as they stand: the shipped values never
    saw that model."""
    fit = [c for c in cases if c.row["split"] == "fit"]
    models = {c.row["model_config"] for c in fit}
    tests = [c for c in cases if c.row["split"] == "test"]
    if any(c.row["model_config"] in models for c in tests):
        return "split"
    if len(models) >= 2:
        return "model"
    closed = [c for c in fit if c.level.kind == "closed"]
    if len({c.level.level for c in closed}) >= 2 and len(closed) == len(fit):
        return "concurrency"
    return "split" if tests else "none"


def inherited(entry: str) -> dict[str, float]:
    """The host's terms ``entry`` takes from its INHERITS donor's profile (none if it has no
    donor)."""
    if entry not in INHERITS:
        return {}
    donor, names = INHERITS[entry]
    profile = load_hardware_profile(PROFILES / f"{donor}.toml")
    values = {**attrs.asdict(profile.efficiency), **attrs.asdict(profile.overheads)}
    return {n: float(values[n]) for n in names}


HOLDOUT_COLUMNS = ("entry", "id", "held_out", "metric", "predicted", "fitted")


def holdout_lines() -> list[dict[str, str]]:
    if not HOLDOUT.is_file():
        return []
    with HOLDOUT.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def read_holdout() -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """The held-out predictions by row id (a blank value: the row did not run), and the
    rows of folds that were not fitted, with the reason."""
    out: dict[str, dict[str, float]] = {}
    unfitted: dict[str, str] = {}
    for line in holdout_lines():
        if not line["metric"]:
            unfitted[line["id"]] = line["fitted"]
            continue
        got = out.setdefault(line["id"], {})
        if line["predicted"]:
            got[line["metric"]] = float(line["predicted"])
    return out, unfitted


def out_of_sample(case: Case, got: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """The row's out-of-sample prediction: its held-out one, else the calibrated entry's
    for a ``test`` row, else None (a fit row of an entry held out by split)."""
    if "held out" in got:
        return got["held out"]
    if case.row["split"] == "test":
        return got["calibrated"]
    return None


def terms_text(entry: str) -> str:
    """The terms an entry is fitted on, and those it takes from its donor."""
    text = ", ".join(terms_of(entry))
    if entry in INHERITS:
        donor, names = INHERITS[entry]
        text += f"; {', '.join(names)} from `{donor}`"
    return text
