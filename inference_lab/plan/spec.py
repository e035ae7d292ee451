"""The plan spec: the candidate space, the workload, the SLO sets, the search and the prices.

Rule 1: a spec is valid as a whole or not at all: every file it names is loaded, every
        axis value and scheduler knob is checked, every SLO key is parsed at load time;
        each problem is one ConfigError line naming the file and the key
        (``plan.toml: slo.mlperf.ttft_p99: ...``).
Rule 2: the candidate space is the cross product, in a fixed order, of model configs x
        hardware x tp x layouts x each scheduler knob (in the spec's order), less the
        points over ``gpu_budget``. The layouts are the aggregated replica counts, then
        the prefill/decode splits (``disaggregation``, each pool of the candidate's entry
        and tp; with splits and no ``replicas``, the aggregated counts are the splits'
        replica totals, so each split meets aggregated candidates of its GPU count). A
        candidate that cannot run (the weights do not fit, tp needs a fabric) is kept
        with its one-line reason, never dropped and never an error of the spec.
Rule 3: paths in a spec are relative to the spec file.
Rule 4: the space is counted without building it (:func:`count_candidates`: the product
        of the axes' lengths) and built lazily, one candidate at a time
        (:func:`iter_candidates`), so a spec of 10^6 candidates costs nothing until it is
        planned, and then only the candidates in flight.

Who calls this: ``inference_lab.plan.cli`` (load), ``inference_lab.plan.planner``.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from inference_lab.core.config import (
    Deployment,
    DisaggregationConfig,
    ModelConfig,
    PoolConfig,
    Workload,
    base_deployment,
    disaggregate,
    load_model_config,
    load_workload,
    read_toml,
    structure_table,
    vary_deployment,
)
from inference_lab.errors import ConfigError
from inference_lab.plan.axes import (
    MAX_REPLICAS,
    Split,
    check_budget,
    int_axis,
    scheduler_axes,
    split_axis,
)
from inference_lab.validation import FieldError

__all__ = [
    "ITL_STEP",
    "METRICS",
    "PRICES_FILE",
    "Candidate",
    "PlanSpec",
    "SearchConfig",
    "Slo",
    "SloSet",
    "Split",
    "count_candidates",
    "expand_candidates",
    "iter_candidates",
    "load_prices",
    "load_spec",
]

#: The latencies an SLO can bound (``sim``'s four and the inter-token latency).
METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
#: ITL percentiles are kept on this grid (percent), so an ITL SLO's percentile is a multiple
#: of it (``inference_lab.plan.jobs.ITL_PERCENTILES``).
ITL_STEP = 0.1
#: The shipped $/GPU-hour table (documented in the file).
PRICES_FILE = Path(__file__).resolve().parent / "prices.toml"

#: Most requests one probe may offer (``max_rate x duration_s``, ``min_requests``): a
#: probe simulates them all in one worker, about 1 KB each.
MAX_PROBE_REQUESTS = 2_000_000
#: The metrics that grow with the waiting queue; every SLO set bounds one (Rule 1).
_QUEUE_AWARE = ("ttft", "e2e", "queue")
_SLO_KEY = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>\d+(?:\.\d+)?)_ms$")
_SPEC_KEYS = (
    "workload",
    "models",
    "hardware",
    "tp",
    "replicas",
    "seed",
    "target_rate",
    "scheduler",
    "search",
    "slo",
    "prices",
    "disaggregation",
    "gpu_budget",
)


def _positive(_inst: Any, attr: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise FieldError(attr.name, f"must be > 0, got {value!r}")


def _at_least(lo: int) -> Any:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: int) -> None:
        if value < lo:
            raise FieldError(attr.name, f"must be >= {lo}, got {value!r}")

    return check


def _fraction(_inst: Any, attr: attrs.Attribute[Any], value: float) -> None:
    if not 0 <= value < 1:
        raise FieldError(attr.name, f"must be in [0, 1), got {value!r}")


@attrs.frozen(kw_only=True)
class SearchConfig:
    """The rate search's stopping rule (``[search]``; docs/planning.md states it).

    A probe at rate R offers Poisson arrivals at R for ``duration_s`` simulated seconds
    (``max(min_requests, ceil(R x duration_s))`` requests, the plan's seed), long enough
    that an overloaded deployment's queue shows in its TTFT. From ``start_rate`` (default:
    the spec's ``target_rate``, else the workload's ``arrival_rate``) the rate doubles
    while every SLO holds (halves while one fails) to bracket the answer, then bisects
    until ``(fail - pass) <= rel_tol * pass``; the answer is the highest rate that passed.
    A probe at ``max_rate`` offers at most :data:`MAX_PROBE_REQUESTS` requests.
    A candidate still passing at ``max_rate`` is reported at ``max_rate`` (capped); one
    failing at ``min_rate`` sustains no rate.
    """

    duration_s: float = attrs.field(default=60.0, validator=_positive)
    min_requests: int = attrs.field(default=200, validator=_at_least(1))
    start_rate: float | None = attrs.field(default=None, validator=_positive)
    min_rate: float = attrs.field(default=0.05, validator=_positive)
    max_rate: float = attrs.field(default=10_000.0, validator=_positive)
    rel_tol: float = attrs.field(default=0.05, validator=_positive)
    #: The share of a probe's requests the candidate may refuse as impossible (longer than
    #: max_seq_len, more KV than a replica holds) before it fails with the refusal's reason.
    max_refused: float = attrs.field(default=0.0, validator=_fraction)

    def __attrs_post_init__(self) -> None:
        if self.min_rate >= self.max_rate:
            raise FieldError("min_rate", f"must be < max_rate ({self.max_rate:g})")
        if self.min_requests > MAX_PROBE_REQUESTS:
            raise FieldError(
                "min_requests", f"must be at most {MAX_PROBE_REQUESTS:,}, got {self.min_requests}"
            )
        largest = self.max_rate * self.duration_s  # (a float: inf past its range)
        if not largest <= MAX_PROBE_REQUESTS:
            raise FieldError(
                "duration_s",
                f"a probe at max_rate ({self.max_rate:g}/s) for {self.duration_s:g} s offers "
                f"{largest:.3g} requests, more than the {MAX_PROBE_REQUESTS:,} a probe may "
                "(its simulation would not fit in memory): lower duration_s or max_rate",
            )

    def requests_at(self, rate: float) -> int:
        """How many requests a probe at `rate` offers."""
        return max(self.min_requests, math.ceil(rate * self.duration_s))


@attrs.frozen
class Slo:
    """One bound: the ``percentile`` of ``metric`` (ms) is at most ``max_ms``."""

    metric: str
    percentile: float
    max_ms: float

    @property
    def label(self) -> str:
        return f"{self.metric.upper()} p{self.percentile:g} <= {self.max_ms:g} ms"


@attrs.frozen
class SloSet:
    """A named set of SLOs (``[slo.<name>]``): a rate meets it when it meets every one."""

    name: str
    slos: tuple[Slo, ...]

    @property
    def label(self) -> str:
        return ", ".join(s.label for s in self.slos)


@attrs.frozen(kw_only=True)
class PlanSpec:
    """A loaded spec (Rule 1). Axes are None where the spec leaves them to each config."""

    path: Path
    workload_path: Path
    workload: Workload
    configs: tuple[ModelConfig, ...]
    hardware: tuple[str, ...] | None
    tp: tuple[int, ...] | None
    replicas: tuple[int, ...] | None
    scheduler: tuple[tuple[str, tuple[Any, ...]], ...]
    slo_sets: tuple[SloSet, ...]
    search: SearchConfig
    prices: Mapping[str, float]
    seed: int
    target_rate: float | None
    #: the prefill/decode splits, after the aggregated replica counts (Rule 2)
    disaggregation: tuple[Split, ...] = ()
    #: the most GPUs a candidate may use (None: no bound)
    gpu_budget: int | None = None

    @property
    def start_rate(self) -> float:
        if self.search.start_rate is not None:
            return self.search.start_rate
        if self.target_rate is not None:
            return self.target_rate
        return self.workload.arrival_rate


@attrs.frozen(kw_only=True)
class Candidate:
    """One point of the candidate space: a deployment, or why there is none (Rule 2)."""

    index: int
    model: str
    config: str  # the model config's path as the spec names it
    hardware: str
    tp: int
    replicas: int  # a split's: both pools' (each replica of tp GPUs)
    knobs: tuple[tuple[str, Any], ...]  # scheduler settings the spec varies
    deployment: Deployment | None
    error: str | None
    price: float | None  # $/GPU-hour, None when the price table has no entry
    split: Split | None = None  # None: aggregated

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    @property
    def cost_per_hour(self) -> float | None:
        return None if self.price is None else self.price * self.gpus

    @property
    def layout(self) -> str:
        """``aggregated`` or the split's ``xPyD``."""
        return "aggregated" if self.split is None else self.split.name

    @property
    def label(self) -> str:
        knobs = "".join(f" {k}={v}" for k, v in self.knobs)
        shape = f"x{self.replicas}" if self.split is None else self.split.name
        return f"{self.model} {self.hardware} tp{self.tp} {shape}{knobs}"


# ---------------------------------------------------------------------------------------
# loading


@attrs.frozen(kw_only=True)
class _SpecFile:
    workload: str = attrs.field(validator=attrs.validators.min_len(1))
    models: list[str] = attrs.field(validator=attrs.validators.min_len(1))
    hardware: list[str] | None = None
    seed: int | None = attrs.field(default=None)
    target_rate: float | None = attrs.field(default=None, validator=_positive)
    gpu_budget: int | None = attrs.field(default=None)
    search: SearchConfig = attrs.field(factory=SearchConfig)
    prices: dict[str, float] = attrs.field(factory=dict)

    @seed.validator
    def _check_seed(self, attr: attrs.Attribute[Any], value: int | None) -> None:
        if value is not None and value < 0:
            raise FieldError(attr.name, f"must be >= 0, got {value!r}")

    @gpu_budget.validator
    def _check_budget(self, attr: attrs.Attribute[Any], value: int | None) -> None:
        if value is not None and value < 1:
            raise FieldError(attr.name, f"must be >= 1, got {value!r}")


def load_prices(path: Path = PRICES_FILE) -> dict[str, float]:
    """The ``[prices]`` table of a price file ($/GPU-hour by hardware profile name)."""
    raw = read_toml(path)
    table = raw.get("prices", {})
    return _prices(table, path, "prices")


def _prices(table: Any, file: Path, where: str) -> dict[str, float]:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{file}: {where}: must be a table, got {table!r}")
    out: dict[str, float] = {}
    for name, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ConfigError(
                f"{file}: {where}.{name}: must be a number >= 0 ($/GPU-hour), got {value!r}"
            )
        out[name] = float(value)
    return out


def _slo_sets(raw: Any, file: Path) -> tuple[SloSet, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{file}: slo: needs at least one [slo.<name>] table of bounds")
    sets = []
    for name, table in raw.items():
        where = f"{file}: slo.{name}"
        if not isinstance(table, Mapping) or not table:
            raise ConfigError(f"{where}: must be a table of bounds like ttft_p99_ms = 2000")
        slos = []
        for key, value in table.items():
            m = _SLO_KEY.match(key)
            if m is None or m["metric"] not in METRICS:
                raise ConfigError(
                    f"{where}.{key}: not a bound: write <metric>_p<percentile>_ms with metric "
                    f"one of {', '.join(METRICS)} (ttft_p99_ms = 2000)"
                )
            pct = float(m["pct"])
            if not 0 < pct <= 100:
                raise ConfigError(f"{where}.{key}: the percentile must be in (0, 100]")
            if m["metric"] == "itl" and not math.isclose(
                pct / ITL_STEP, round(pct / ITL_STEP), abs_tol=1e-9
            ):
                raise ConfigError(
                    f"{where}.{key}: an ITL percentile must be a multiple of {ITL_STEP:g}"
                )
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{where}.{key}: must be a number of ms > 0, got {value!r}")
            slos.append(Slo(m["metric"], pct, float(value)))
        if not any(s.metric in _QUEUE_AWARE for s in slos):
            raise ConfigError(
                f"{where}: bound TTFT, E2E or queue too: an overloaded deployment keeps its "
                "TPOT and ITL while its queue grows, so only those see it"
            )
        sets.append(SloSet(str(name), tuple(slos)))
    return tuple(sets)


def _relative(file: Path, written: str) -> Path:
    path = Path(written).expanduser()
    # normpath, not resolve: configs/plans/../x.toml is configs/x.toml in every message
    return path if path.is_absolute() else Path(os.path.normpath(file.parent / path))


def load_spec(path: str | Path, prices_file: Path = PRICES_FILE) -> PlanSpec:
    """Read and check a plan spec and every file it names (Rule 1); raises ConfigError."""
    file = Path(path)
    raw = read_toml(file)
    for key in raw:
        if key not in _SPEC_KEYS:
            raise ConfigError(
                f"{file}: {key}: unknown key (a plan spec holds {', '.join(_SPEC_KEYS)})"
            )
    axis_keys = ("tp", "replicas", "scheduler", "slo", "disaggregation")
    axes = {k: raw.pop(k) for k in axis_keys if k in raw}
    top = structure_table(raw, _SpecFile, file)
    budget = top.gpu_budget
    tp = int_axis(axes["tp"], file, "tp") if "tp" in axes else None
    replicas = (
        int_axis(axes["replicas"], file, "replicas", MAX_REPLICAS) if "replicas" in axes else None
    )
    for key, values in (("tp", tp), ("replicas", replicas)):
        if values is not None:
            check_budget(values, file, key, budget)
    splits = split_axis(axes["disaggregation"], file, budget) if "disaggregation" in axes else ()
    if splits and replicas is None:  # Rule 2: each split meets aggregated candidates of its GPUs
        replicas = tuple(dict.fromkeys(s.replicas for s in splits))
    workload_path = _relative(file, top.workload)
    workload = load_workload(workload_path)
    configs = tuple(load_model_config(_relative(file, m)) for m in top.models)
    prices = load_prices(prices_file)
    prices.update(_prices(top.prices, file, "prices"))
    return PlanSpec(
        path=file,
        workload_path=workload_path,
        workload=workload,
        configs=configs,
        hardware=tuple(dict.fromkeys(top.hardware)) if top.hardware else None,
        tp=tp,
        replicas=replicas,
        scheduler=scheduler_axes(axes.get("scheduler", {}), file),
        slo_sets=_slo_sets(axes.get("slo"), file),
        search=top.search,
        prices=prices,
        seed=workload.seed if top.seed is None else top.seed,
        target_rate=top.target_rate,
        disaggregation=splits,
        gpu_budget=budget,
    )


# ---------------------------------------------------------------------------------------
# the candidate space


def _written(spec: PlanSpec, config: ModelConfig) -> str:
    try:
        return str(config.path.relative_to(spec.path.parent))
    except ValueError:
        return str(config.path)


def _hardware_names(spec: PlanSpec, config: ModelConfig) -> tuple[str, ...]:
    return spec.hardware if spec.hardware is not None else tuple(config.deployments)


#: A layout of the space (Rule 2): an aggregated replica count, or a split.
Layout = int | Split


def _points(spec: PlanSpec, base: Deployment) -> Iterator[tuple[int, Layout]]:
    """The (tp, layout) pairs of one model config x hardware, in order, within the budget
    (Rule 2)."""
    tps = spec.tp if spec.tp is not None else (base.hardware.tp,)
    reps = spec.replicas if spec.replicas is not None else (base.hardware.replicas,)
    layouts: tuple[Layout, ...] = (*reps, *spec.disaggregation)
    budget = spec.gpu_budget
    for tp in tps:
        for layout in layouts:
            replicas = layout if isinstance(layout, int) else layout.replicas
            if budget is None or tp * replicas <= budget:
                yield tp, layout


def count_candidates(spec: PlanSpec) -> int:
    """How many candidates the spec's space holds (Rule 4), without building one.
    ConfigError, as :func:`iter_candidates` would raise it, for a hardware name with no
    entry and no profile (each model config x hardware name is checked: a few calls)."""
    per_point = 1
    for _, values in spec.scheduler:
        per_point *= len(values)
    total = 0
    for config in spec.configs:
        for hw in _hardware_names(spec, config):
            base = base_deployment(config, hw)
            if spec.gpu_budget is None:  # the product, not a walk: a 10^6 space is counted at once
                tps = len(spec.tp) if spec.tp is not None else 1
                reps = len(spec.replicas) if spec.replicas is not None else 1
                points = tps * (reps + len(spec.disaggregation))
            else:
                points = sum(1 for _ in _points(spec, base))
            total += points * per_point
    return total


def _variant(
    spec: PlanSpec, base: Deployment, tp: int, layout: Layout, knobs: dict[str, Any]
) -> Deployment:
    """The deployment of one point: ``base`` with its tp, replicas and knobs; for a split,
    ``base`` with its tp and knobs split as ``sim --pd`` splits a deployment (both pools
    of the entry and tp; the link, routers and hand-off at their defaults), so the job is
    the one ``sim --pd xPyD`` runs on that deployment. Raises ConfigError, one line."""
    if isinstance(layout, int):
        return vary_deployment(base, tp=tp, replicas=layout, scheduler=knobs, where=str(spec.path))
    dep = vary_deployment(base, tp=tp, scheduler=knobs, where=str(spec.path))
    split = DisaggregationConfig(
        prefill=PoolConfig(replicas=layout.prefill), decode=PoolConfig(replicas=layout.decode)
    )
    return disaggregate(dep, split, {}, f"{spec.path}: disaggregation: {layout.name}")


def iter_candidates(spec: PlanSpec) -> Iterator[Candidate]:
    """Every candidate of the spec's space in order (Rule 2), each with its deployment or
    its one-line reason, built as it is asked for (Rule 4). ConfigError only for a hardware
    name with no entry and no profile (a typo in the spec)."""
    index = 0
    knob_names = [name for name, _ in spec.scheduler]
    knob_values: Sequence[tuple[Any, ...]] = [values for _, values in spec.scheduler]
    for config in spec.configs:
        for hw in _hardware_names(spec, config):
            base = base_deployment(config, hw)
            for tp, layout in _points(spec, base):  # a generator: Rule 4
                for combo in itertools.product(*knob_values):
                    knobs = tuple(zip(knob_names, combo, strict=True))
                    deployment: Deployment | None = None
                    error: str | None = None
                    try:
                        deployment = _variant(spec, base, tp, layout, dict(knobs))
                    except ConfigError as exc:
                        error = str(exc)
                    yield Candidate(
                        index=index,
                        model=config.model.name,
                        config=_written(spec, config),
                        hardware=hw,
                        tp=tp,
                        replicas=layout if isinstance(layout, int) else layout.replicas,
                        knobs=knobs,
                        deployment=deployment,
                        error=error,
                        price=spec.prices.get(hw),
                        split=None if isinstance(layout, int) else layout,
                    )
                    index += 1


def expand_candidates(spec: PlanSpec) -> list[Candidate]:
    """:func:`iter_candidates` as a list (tests and small spaces)."""
    return list(iter_candidates(spec))
