"""Fitting the step model's efficiency terms (or time_correction) to measurements.

Rule 1: a load level is compared with the same workload re-simulated on the candidate
        deployment (:func:`inference_lab.sim.run.run_simulation`): a closed loop at the
        level's concurrency (its users' starts spread over ``start_spread`` seconds),
        Poisson arrivals at its rate, or its requests all at t = 0,
        with every prompt and output at the level's mean lengths; a measured step with
        the step model's price of the even batch its coordinates describe
        (``Roofline.even_price``).
Rule 2: the fit is least squares on the logarithms of predicted / measured (every metric
        of every level and every step one residual, so a 10 % miss weighs the same on
        TTFT and throughput), by Levenberg-Marquardt with forward-difference Jacobians
        (numpy only), each parameter kept within its bounds; it starts from the
        deployment's own values (:func:`difference_steps` says which differences).
Rule 3: a simulation is a pure function of the deployment and the workload, so a fit is
        deterministic and its evaluations are cached by parameter vector.
Rule 4: errors are reported as MAPE per metric (mean of |predicted - measured| /
        measured, in %), before (the deployment as loaded) and after the fit.
Rule 5: a fit the measurements cannot determine is refused before it runs, one line
        naming the terms (:func:`check_determined`): fewer measured values than terms, a
        term no measured value moves, two terms that move them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

from inference_lab.calibrate.measurements import METRICS, LoadLevel, Measurements, StepSample
from inference_lab.core.config import (
    Deployment,
    EfficiencyOverride,
    FixedDist,
    Workload,
)
from inference_lab.core.roofline import Roofline
from inference_lab.errors import CalibrationError
from inference_lab.sim.itl import ItlRecorder
from inference_lab.sim.run import run_simulation

__all__ = [
    "PARAMETERS",
    "EFFICIENCY_TERMS",
    "PRESETS",
    "FitResult",
    "Parameter",
    "apply",
    "fit",
    "check_determined",
    "fit_cases",
    "is_missing",
    "merge",
    "mape",
    "predict",
    "simulate_level",
]


@attrs.frozen
class Parameter:
    """A fittable term: its bounds and the unit the solver steps it in (``scale``
    seconds per unit for the time terms, so they move in milliseconds)."""

    name: str
    lower: float
    upper: float
    scale: float = 1.0


PARAMETERS: dict[str, Parameter] = {
    "memory_bandwidth": Parameter("memory_bandwidth", 0.05, 1.0),
    "flops": Parameter("flops", 0.05, 1.0),
    "step_overhead": Parameter("step_overhead", 0.0, 0.1, 1e-3),
    "expert_skew": Parameter("expert_skew", 0.0, 2.0),
    "layer_overhead": Parameter("layer_overhead", 0.0, 1e-3, 1e-5),
    "seq_overhead": Parameter("seq_overhead", 0.0, 1e-3, 1e-6),
    "frontend_latency": Parameter("frontend_latency", 0.0, 2.0, 1e-3),
    # stepped in units of 100 GB so that a difference (0.003) moves whole KV blocks
    "reserved_memory": Parameter("reserved_memory", 0.0, 4e10, 1e11),
    "alpha": Parameter("alpha", 0.1, 10.0),
    "beta": Parameter("beta", 0.0, 0.1, 1e-3),
}


def shown(name: str, value: float) -> str:
    """A term's value as the reports print it: fractions and exponents bare, the time terms
    in ms or µs (as the solver steps them), the reserved memory in GB."""
    if name == "reserved_memory":
        return f"{value / 1e9:.4g} GB"
    scale = PARAMETERS[name].scale
    if scale == 1.0:
        return f"{value:.4g}"
    if scale >= 1e-3:
        return f"{value / 1e-3:.4g} ms"
    return f"{value / 1e-6:.4g} us"


#: The terms of ``[efficiency]``; ``seq_overhead`` and ``frontend_latency`` are the
#: ``[overheads]`` table's (fitted only when named; the second is set on the scheduler, where
#: the loader puts the profile's).
EFFICIENCY_TERMS = ("memory_bandwidth", "flops", "step_overhead", "expert_skew", "layer_overhead")
#: ``--fit`` shorthands.
PRESETS: dict[str, tuple[str, ...]] = {
    "efficiency": ("memory_bandwidth", "flops", "step_overhead"),
    "time_correction": ("alpha", "beta"),
}


def current(dep: Deployment, names: Sequence[str]) -> list[float]:
    """The deployment's own values of the parameters ``names``."""
    eff, tc = dep.efficiency, dep.hardware.time_correction
    values = {
        "memory_bandwidth": eff.memory_bandwidth,
        "flops": eff.flops,
        "step_overhead": eff.step_overhead,
        "expert_skew": eff.expert_skew,
        "layer_overhead": eff.layer_overhead,
        "seq_overhead": dep.overheads.seq_overhead,
        "frontend_latency": dep.scheduler.frontend_latency,
        "reserved_memory": dep.overheads.reserved_memory,
        "alpha": tc.alpha,
        "beta": tc.beta,
    }
    return [values[n] for n in names]


def apply(dep: Deployment, values: dict[str, float]) -> Deployment:
    """``dep`` with the named efficiency / time_correction / overheads terms set (on the entry,
    so they win over the profile's; ``frontend_latency`` on the scheduler, absolute)."""
    hw = dep.hardware
    eff_keys = {k: v for k, v in values.items() if k in EFFICIENCY_TERMS}
    tc_keys = {k: v for k, v in values.items() if k in PRESETS["time_correction"]}
    if eff_keys:
        base = hw.efficiency or EfficiencyOverride()
        hw = attrs.evolve(hw, efficiency=attrs.evolve(base, **eff_keys))
    if tc_keys:
        hw = attrs.evolve(hw, time_correction=attrs.evolve(hw.time_correction, **tc_keys))
    if "seq_overhead" in values or "reserved_memory" in values:
        over = dep.overheads
        if "seq_overhead" in values:
            over = attrs.evolve(over, seq_overhead=values["seq_overhead"])
        if "reserved_memory" in values:
            over = attrs.evolve(over, reserved_memory=values["reserved_memory"])
        hw = attrs.evolve(hw, overheads=over)
    sched = dep.scheduler
    if "frontend_latency" in values:
        sched = attrs.evolve(sched, frontend_latency=values["frontend_latency"])
    return attrs.evolve(dep, hardware=hw, scheduler=sched)


def level_workload(level: LoadLevel, requests: int) -> Workload:
    """The workload of Rule 1 for ``level``, ``requests`` long."""
    inputs = FixedDist(value=level.prompt_tokens)
    outputs = FixedDist(value=level.output_tokens)
    if level.kind == "closed":
        return Workload(
            arrival_pattern="closed_loop",
            num_concurrent_users=round(level.level),
            closed_loop_jitter_secs=level.start_spread,
            num_requests=requests,
            input_len_dist=inputs,
            output_len_dist=outputs,
            seed=0,
        )
    if level.kind == "open":
        return Workload(
            arrival_pattern="poisson",
            arrival_rate=level.level,
            num_requests=requests,
            input_len_dist=inputs,
            output_len_dist=outputs,
            seed=0,
        )
    return Workload(
        arrival_pattern="batched",
        num_requests=requests,
        input_len_dist=inputs,
        output_len_dist=outputs,
        seed=0,
    )


def sim_requests(level: LoadLevel, cap: int) -> int:
    """How many requests the level is re-simulated with: a batch its own size (never cut:
    its tail is part of its throughput); a closed loop the measured count, at least 32
    and 4 per user, at most ``cap`` unless 4 per user need more (a ``lock_step`` run
    exactly the measured count: its waves); an open loop the measured count or a minute of
    arrivals, at least 100, at most ``cap``."""
    if level.kind == "batched":
        return round(level.level)
    if level.lock_step and level.requests is not None:
        return level.requests
    if level.kind == "closed":
        users = round(level.level)
        want = max(level.requests or 0, 4 * users, 32)
        return min(want, max(cap, 4 * users))
    want = max(level.requests or 0, round(60 * level.level), 100)
    return min(want, cap)


def simulate_level(dep: Deployment, level: LoadLevel, cap: int) -> dict[str, float]:
    """The level's metrics predicted by re-simulating it (Rule 1): mean TTFT and TPOT in
    seconds, output tokens/s, and where the level measured it the median inter-token
    latency (:mod:`inference_lab.sim.itl`); a metric no completed request gives is
    absent."""
    itl = ItlRecorder() if level.itl is not None else None
    workload = level_workload(level, sim_requests(level, cap))
    result = run_simulation(dep, workload, on_events=None if itl is None else itl.observe)
    s = result.summary
    out = {}
    if s.output_tokens_per_s > 0:
        out["throughput"] = s.output_tokens_per_s
    if s.ttft.mean is not None:
        out["ttft"] = s.ttft.mean / 1e3
    if s.tpot.mean is not None:
        out["tpot"] = s.tpot.mean / 1e3
    median = None if itl is None else itl.median()
    if median is not None:
        out["itl"] = median
    return out


def predict_step(roofline: Roofline, step: StepSample) -> float:
    return roofline.even_price(step.batch_size, step.prefill_tokens, step.context_tokens)


@attrs.frozen
class Prediction:
    """Predicted and measured values, per metric, in measurement order."""

    pairs: dict[str, list[tuple[float, float]]]

    def residuals(self) -> np.ndarray[tuple[int], np.dtype[np.float64]]:
        out = [
            math.log(max(p, 1e-300) / m)
            for metric in METRICS
            for p, m in self.pairs.get(metric, [])
        ]
        return np.array(out, dtype=np.float64)


#: A measured metric the re-simulation cannot give (no request of the level completed: the
#: candidate's KV cache holds none) is predicted as this many times the measured value, so
#: the residuals keep their layout and the fit is steered away (Rule 2).
MISSING = 1e3


def is_missing(predicted: float, measured: float) -> bool:
    """Whether ``predicted`` is :data:`MISSING`'s stand-in, not a prediction (reports
    leave it out and say the level did not run)."""
    return predicted == MISSING * measured


def predict(dep: Deployment, data: Measurements, cap: int) -> Prediction:
    """Every measured value next to the deployment's prediction of it."""
    pairs: dict[str, list[tuple[float, float]]] = {m: [] for m in METRICS}
    for level in data.levels:
        predicted = simulate_level(dep, level, cap)
        for metric, measured in level.measured().items():
            pairs[metric].append((predicted.get(metric, MISSING * measured), measured))
    if data.steps:
        roofline = Roofline(attrs.evolve(dep, step_table=None))
        for step in data.steps:
            pairs["step"].append((predict_step(roofline, step), step.step_seconds))
    return Prediction({k: v for k, v in pairs.items() if v})


def mape(prediction: Prediction) -> dict[str, float]:
    """Rule 4: the mean absolute percentage error of each metric (a level that did not
    run counts with :data:`MISSING`'s stand-in: 99,900 %)."""
    return {
        metric: 100.0 * sum(abs(p - m) / m for p, m in pairs) / len(pairs)
        for metric, pairs in prediction.pairs.items()
    }


@attrs.frozen(kw_only=True)
class FitResult:
    names: tuple[str, ...]
    initial: tuple[float, ...]
    values: tuple[float, ...]
    before: Prediction
    after: Prediction
    evaluations: int
    iterations: int
    #: Each case's prediction with the fitted values, in the order of the cases.
    cases_after: tuple[Prediction, ...] = ()

    @property
    def fitted(self) -> dict[str, float]:
        return dict(zip(self.names, self.values, strict=True))


def levenberg_marquardt(
    residuals: Callable[
        [np.ndarray[tuple[int], np.dtype[np.float64]]], np.ndarray[tuple[int], np.dtype[np.float64]]
    ],
    x0: np.ndarray[tuple[int], np.dtype[np.float64]],
    lower: np.ndarray[tuple[int], np.dtype[np.float64]],
    upper: np.ndarray[tuple[int], np.dtype[np.float64]],
    *,
    step: float = 0.003,
    max_iterations: int = 40,
    rtol: float = 1e-3,
) -> tuple[np.ndarray[tuple[int], np.dtype[np.float64]], int]:
    """Minimise ``|residuals(x)|²`` over the box ``[lower, upper]`` (Rule 2): a damped
    Gauss-Newton step from a forward-difference Jacobian (a backward difference at an
    upper bound), projected into the box; the damping falls after a step that lowered
    the cost and rises after one that did not. It stops when a step lowers the cost by
    less than ``rtol`` of it, when no step lowers it, or after ``max_iterations``.
    Returns the best point and the iterations taken."""
    x = np.clip(x0, lower, upper)
    r = residuals(x)
    cost = float(r @ r)
    damping = 1e-2
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007 - reported
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            h = step if x[j] + step <= upper[j] else -step
            probe = x.copy()
            probe[j] += h
            jac[:, j] = (residuals(probe) - r) / h
        jtj = jac.T @ jac
        grad = jac.T @ r
        improved = False
        while damping < 1e8:
            diag = np.diag(np.diag(jtj)) + 1e-9 * np.eye(x.size)
            delta = np.linalg.solve(jtj + damping * diag, -grad)
            candidate = np.clip(x + delta, lower, upper)
            if np.allclose(candidate, x, rtol=0, atol=1e-9):
                break
            r_new = residuals(candidate)
            new_cost = float(r_new @ r_new)
            if new_cost < cost:
                gain = cost - new_cost
                improved = gain > rtol * cost and new_cost > 1e-20
                x, r, cost = candidate, r_new, new_cost
                damping = max(damping / 3, 1e-7)
                break
            damping *= 4
        if not improved:
            break
    return x, iterations


def fit(dep: Deployment, data: Measurements, names: Sequence[str], cap: int = 1000) -> FitResult:
    """Fit the parameters ``names`` (keys of :data:`PARAMETERS`) of ``dep`` to ``data``."""
    return fit_cases([(dep, data)], names, cap)


#: How the cases of one evaluation are run: ``map`` (in process) or a pool's ``map``
#: (``concurrent.futures``); the jobs are pure, so either gives the same numbers (Rule 3).
Mapper = Callable[
    [
        Callable[[tuple[Deployment, Measurements, int]], Prediction],
        list[tuple[Deployment, Measurements, int]],
    ],
    Iterable[Prediction],
]


def predict_job(job: tuple[Deployment, Measurements, int]) -> Prediction:
    """One case of an evaluation (a module-level function, so a process pool can run it)."""
    return predict(*job)


def predict_cases(
    cases: Sequence[tuple[Deployment, Measurements]], cap: int, mapper: Mapper = map
) -> Prediction:
    """:func:`predict` over several deployments (one prediction, their pairs in order)."""
    return merge(list(mapper(predict_job, [(dep, data, cap) for dep, data in cases])))


def merge(predictions: Sequence[Prediction]) -> Prediction:
    """Several predictions as one, their pairs in order, metric by metric."""
    pairs: dict[str, list[tuple[float, float]]] = {}
    for prediction in predictions:
        for metric, values in prediction.pairs.items():
            pairs.setdefault(metric, []).extend(values)
    return Prediction({m: pairs[m] for m in METRICS if m in pairs})


def difference_steps(cases: Sequence[tuple[Deployment, Measurements]]) -> tuple[float, ...]:
    """The Jacobian's difference steps, pass after pass (in the solver's units: a fraction,
    or milliseconds). A closed loop whose users start spread out (``start_spread``) runs
    desynchronised, and tiny changes of the terms reorder its events, so its metrics move
    in small jumps: a first pass with differences of 0.02 sees past them, a second of
    0.003 refines. Anything else (steps, batches, lock-step loops, Poisson arrivals whose
    times do not depend on the terms) is smooth enough for 0.003 alone."""
    spread = any(level.start_spread > 0 for _, data in cases for level in data.levels)
    return (0.02, 0.003) if spread else (0.003,)


def fit_cases(
    cases: Sequence[tuple[Deployment, Measurements]],
    names: Sequence[str],
    cap: int = 1000,
    mapper: Mapper = map,
    max_iterations: int = 40,
) -> FitResult:
    """Fit the parameters ``names`` shared by several deployments (one GPU and engine
    measured on several models or settings) to their measurements; the start is the
    first deployment's values. ``mapper`` runs an evaluation's cases (``map``, or a
    process pool's). Rule 5: an under-determined fit is refused before it runs."""
    params = [PARAMETERS[n] for n in names]
    scale = np.array([p.scale for p in params])
    lower = np.array([p.lower for p in params]) / scale
    upper = np.array([p.upper for p in params]) / scale
    initial = current(cases[0][0], names)
    cache: dict[tuple[float, ...], list[Prediction]] = {}

    def each(x: np.ndarray[tuple[int], np.dtype[np.float64]]) -> list[Prediction]:
        key = tuple(float(v) for v in x)
        if key not in cache:
            values = dict(zip(names, (float(v) for v in x * scale), strict=True))
            jobs = [(apply(d, values), m, cap) for d, m in cases]
            cache[key] = list(mapper(predict_job, jobs))
        return cache[key]

    def residuals(
        x: np.ndarray[tuple[int], np.dtype[np.float64]],
    ) -> np.ndarray[tuple[int], np.dtype[np.float64]]:
        return merge(each(x)).residuals()

    x0 = np.clip(np.array(initial) / scale, lower, upper)
    steps = difference_steps(cases)
    check_determined(residuals, x0, upper, names, steps[0])
    best, iterations = x0, 0
    for step in steps:
        best, done = levenberg_marquardt(
            residuals, best, lower, upper, step=step, max_iterations=max_iterations
        )
        iterations += done
    values = tuple(float(v) for v in best * scale)
    return FitResult(
        names=tuple(names),
        initial=tuple(initial),
        values=values,
        before=merge(each(x0)),
        after=merge(each(best)),
        evaluations=len(cache),
        iterations=iterations,
        cases_after=tuple(each(best)),
    )


#: Rule 5: a fit is under-determined when its normalised Jacobian has a singular value
#: below this (two terms whose effects on every measured value agree to within 0.02 %).
DETERMINED = 0.02


def check_determined(
    residuals: Callable[
        [np.ndarray[tuple[int], np.dtype[np.float64]]], np.ndarray[tuple[int], np.dtype[np.float64]]
    ],
    x0: np.ndarray[tuple[int], np.dtype[np.float64]],
    upper: np.ndarray[tuple[int], np.dtype[np.float64]],
    names: Sequence[str],
    step: float,
) -> None:
    """Rule 5: CalibrationError, one line naming the term(s), when the measurements cannot
    determine the terms: fewer measured values than terms, a term that moves no measured
    value, or terms that move them alike. The Jacobian's probes are the solver's first
    ones (the evaluations are cached), so the check costs nothing."""
    r0 = residuals(x0)
    if r0.size < len(names):
        raise CalibrationError(
            f"fit: {r0.size} measured value(s) cannot determine {len(names)} terms "
            f"({', '.join(names)}); fit fewer terms or add measurements"
        )
    jac = np.empty((r0.size, len(names)))
    for j in range(len(names)):
        h = step if x0[j] + step <= upper[j] else -step
        probe = x0.copy()
        probe[j] += h
        jac[:, j] = (residuals(probe) - r0) / h
    norms = np.sqrt((jac**2).sum(axis=0))
    for j, name in enumerate(names):
        if norms[j] < 1e-9:
            raise CalibrationError(
                f"fit: term {name}: no measured value moves it; leave it out of --fit"
            )
    unit = jac / norms
    if len(names) > 1 and np.linalg.svd(unit, compute_uv=False)[-1] < DETERMINED:
        cos = np.abs(unit.T @ unit)
        np.fill_diagonal(cos, 0.0)
        a, b = (int(i) for i in np.unravel_index(int(np.argmax(cos)), cos.shape))
        raise CalibrationError(
            f"fit: terms {names[a]} and {names[b]} move the measured values alike "
            f"(correlation {cos[a, b]:.4f}): the measurements cannot tell them apart; "
            "fit one of them"
        )
