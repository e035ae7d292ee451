"""Fitting one calibrated entry (one GPU and engine) to the rows of a measurement table
that name it, across every model they cover, and measuring the fit out of sample.

``inference-lab calibrate --table`` and ``scripts/fidelity.py`` call :func:`fit_entry`
and :func:`holdout`; the rows are read by :mod:`inference_lab.calibrate.table`.

Rule 1: the terms are shared: one set of values prices every model of the entry (the
        per-GPU, per-engine terms), fitted jointly on all the entry's rows
        (:func:`inference_lab.calibrate.fit.fit_cases`).
Rule 2: out of sample means by whole models, and separately by whole load ranges: a
        ``model`` hold-out refits without each model in turn and predicts that model's
        rows; a ``concurrency`` hold-out splits each series' load levels (one model and
        request shape) at their median and fits the lower range of every series to
        predict the upper, and the other way round. A fold is only made when both its
        sides have rows; with one model there is no model hold-out (the reason is
        reported). A fold the rows it is fitted on cannot determine is reported with the
        reason, not fitted.
Rule 3: residuals are reported per model and per load level: the MAPE and the mean signed
        error (predicted / measured - 1) of each metric.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs

from inference_lab.calibrate.fit import (
    FitResult,
    Mapper,
    Prediction,
    apply,
    fit_cases,
    is_missing,
)
from inference_lab.calibrate.measurements import METRICS, Measurements
from inference_lab.calibrate.table import Case
from inference_lab.errors import CalibrationError

__all__ = [
    "HOLDOUTS",
    "Fold",
    "GroupError",
    "fit_entry",
    "group_errors",
    "holdout",
    "not_run",
    "pooled",
    "predict_rows",
]

HOLDOUTS = ("model", "concurrency")


def fit_entry(
    cases: Sequence[Case],
    names: Sequence[str],
    cap: int = 1000,
    mapper: Mapper = map,
    max_iterations: int = 40,
) -> FitResult:
    """Rule 1: the terms ``names`` fitted jointly on ``cases`` (every row of one entry);
    ``result.cases_after`` holds each row's prediction with the fitted values."""
    return fit_cases(
        [(c.deployment, Measurements(levels=(c.level,))) for c in cases],
        names,
        cap,
        mapper,
        max_iterations,
    )


def predict_rows(
    cases: Sequence[Case], values: dict[str, float], cap: int = 1000, mapper: Mapper = map
) -> list[Prediction]:
    """Each case's prediction with the terms ``values`` set (the held-out side of a fold)."""
    from inference_lab.calibrate.fit import predict_job

    jobs = [(apply(c.deployment, values), Measurements(levels=(c.level,)), cap) for c in cases]
    return list(mapper(predict_job, jobs))


@attrs.frozen
class Fold:
    """One fold of a hold-out: what was held out (a model's name, or ``levels a-b``), the
    rows fitted and held out, the values fitted without the held-out rows and the
    held-out rows' predictions with them."""

    held_out: str
    fitted_on: tuple[Case, ...]
    tested_on: tuple[Case, ...]
    values: dict[str, float]
    predictions: tuple[Prediction, ...]
    #: Why the fold was not fitted (its rows cannot determine the terms), or "".
    unfitted: str = ""


def _model_folds(cases: Sequence[Case]) -> list[tuple[str, list[Case], list[Case]]]:
    models = sorted({c.row["model_config"] for c in cases})
    if len(models) < 2:
        return []
    return [
        (
            model,
            [c for c in cases if c.row["model_config"] != model],
            [c for c in cases if c.row["model_config"] == model],
        )
        for model in models
    ]


def _level_folds(cases: Sequence[Case]) -> list[tuple[str, list[Case], list[Case]]]:
    """Rule 2's load ranges: within each series (one model and shape: scenario, lengths)
    the levels at or below the series' median are the lower range, the rest the upper; a
    series of one level is in both fits and in neither test."""
    series: dict[tuple[str, str, int, int], list[Case]] = {}
    for c in cases:
        key = (c.row["model_config"], c.level.kind, c.level.prompt_tokens, c.level.output_tokens)
        series.setdefault(key, []).append(c)
    low: list[Case] = []
    high: list[Case] = []
    shared: list[Case] = []
    for members in series.values():
        levels = sorted({c.level.level for c in members})
        if len(levels) < 2:
            shared += members
            continue
        cut = statistics.median(levels)
        low += [c for c in members if c.level.level <= cut]
        high += [c for c in members if c.level.level > cut]
    if not low or not high:
        return []
    lo_name = f"lower levels ({_fmt(min(c.level.level for c in low))}-{_fmt(max(c.level.level for c in low))})"
    hi_name = f"upper levels ({_fmt(min(c.level.level for c in high))}-{_fmt(max(c.level.level for c in high))})"
    return [(hi_name, low + shared, high), (lo_name, high + shared, low)]


def _fmt(value: float) -> str:
    return f"{value:g}"


def holdout(
    cases: Sequence[Case],
    names: Sequence[str],
    by: str,
    cap: int = 1000,
    mapper: Mapper = map,
    max_iterations: int = 40,
) -> list[Fold]:
    """Rule 2: the folds of the hold-out ``by`` (``model`` or ``concurrency``), each fitted
    on its rows and predicting the held-out ones; [] when there is nothing to hold out."""
    if by not in HOLDOUTS:
        raise ValueError(f"holdout: must be one of {', '.join(HOLDOUTS)}, got {by!r}")
    splits = _model_folds(cases) if by == "model" else _level_folds(cases)
    folds = []
    for held_out, fit_on, test_on in splits:
        try:
            result = fit_entry(fit_on, names, cap, mapper, max_iterations)
        except CalibrationError as exc:
            folds.append(Fold(held_out, tuple(fit_on), tuple(test_on), {}, (), str(exc)))
            continue
        predictions = predict_rows(test_on, result.fitted, cap, mapper)
        folds.append(
            Fold(held_out, tuple(fit_on), tuple(test_on), result.fitted, tuple(predictions))
        )
    return folds


@attrs.frozen
class GroupError:
    """Rule 3: one group's rows and, per metric, (MAPE %, mean signed error %, count)."""

    group: str
    rows: int
    metrics: dict[str, tuple[float, float, int]]


def group_errors(
    cases: Sequence[Case], predictions: Sequence[Prediction], key: str
) -> list[GroupError]:
    """Rule 3: the errors of ``predictions`` (one per case, in order) grouped by the model
    (``key="model"``) or by the load level (``key="level"``)."""
    groups: dict[str, list[Prediction]] = {}
    order: dict[str, float] = {}
    for case, prediction in zip(cases, predictions, strict=True):
        if key == "model":
            name = case.row["model_config"]
            order.setdefault(name, len(order))
        else:
            name = f"{case.level.kind} {_fmt(case.level.level)}"
            order.setdefault(name, case.level.level)
        groups.setdefault(name, []).append(prediction)
    return [
        GroupError(name, len(groups[name]), pooled(groups[name]))
        for name in sorted(groups, key=lambda n: (order[n], n))
    ]


def pooled(predictions: Sequence[Prediction]) -> dict[str, tuple[float, float, int]]:
    """Per metric, the MAPE and the mean signed error (both in %) of every pair in
    ``predictions`` that is a prediction, and how many there are (a level that did not
    run is left out: :func:`not_run` counts them)."""
    metrics = {}
    for metric in METRICS:
        errors = [
            p / m - 1.0
            for pred in predictions
            for p, m in pred.pairs.get(metric, [])
            if not is_missing(p, m)
        ]
        if errors:
            metrics[metric] = (
                100.0 * sum(abs(e) for e in errors) / len(errors),
                100.0 * sum(errors) / len(errors),
                len(errors),
            )
    return metrics


def not_run(predictions: Sequence[Prediction]) -> int:
    """How many of ``predictions`` hold a level that did not run (no request completed:
    the KV cache the terms leave holds none)."""
    return sum(
        any(is_missing(p, m) for pairs in pred.pairs.values() for p, m in pairs)
        for pred in predictions
    )
