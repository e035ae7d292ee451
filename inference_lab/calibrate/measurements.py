"""Measurements of a real server, read for ``inference-lab calibrate``.

Four formats, told apart by their content (docs/fidelity.md#calibrate):

- an ``inference-lab load -o`` JSON document (``summary`` and ``config``; seconds);
- an aiperf ``profile_export_aiperf.json`` (top-level metrics such as
  ``time_to_first_token`` with a ``unit`` and ``avg``, and ``input_config.loadgen``);
- a guidellm ``benchmarks.json`` (``benchmarks``: one load level per benchmark, its
  ``args.strategy`` and its ``metrics`` as distributions by status);
- a step CSV (the step table's columns, any rows: not necessarily a grid).

Rule 1: a load level becomes a :class:`LoadLevel`: the workload that produced it
        (closed loop at a concurrency, Poisson at a rate, or a batch of requests sent at
        once), its mean prompt and output lengths, and the means measured (TTFT, TPOT,
        output tokens/s) with, where the file pools every stream's gaps (``inference-lab
        load``'s ``summary.itl``), the median inter-token latency; a metric a file does
        not hold is None and is not fitted.
        A closed loop's users start spread over one measured request (:func:`start_spread`).
Rule 2: every problem is a ConfigError of one line naming the file and the key (or the
        CSV line): unreadable, not one of the formats (JSON nested deeper than the
        decoder allows included), a key missing or of the wrong type, a value out of
        range (a concurrency above :data:`MAX_USERS` or a rate above :data:`MAX_RATE`,
        which a re-simulation could not hold, lengths above :data:`MAX_TOKENS`), a load level that has no fixed load (an adaptive ``load``
        run, guidellm's ``throughput`` sweep), a model that is not the config's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from inference_lab.core.step_table import parse_step_rows
from inference_lab.errors import ConfigError

__all__ = [
    "MAX_RATE",
    "MAX_TOKENS",
    "MAX_USERS",
    "LoadLevel",
    "Measurements",
    "StepSample",
    "read_measurements",
    "start_spread",
]

#: What each metric is called in reports.
METRICS = ("ttft", "tpot", "itl", "throughput", "step")

_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}
#: Highest closed-loop concurrency read (Rule 2): a fit re-simulates at least 4 requests
#: per user at every evaluation, so 1e7 users would hold the fit for hours.
MAX_USERS = 10_000
#: Highest open-loop rate read, requests/s.
MAX_RATE = 1_000_000.0
#: Longest mean prompt or output read, tokens (as a trace's, ``traffic.traces``).
MAX_TOKENS = 10_000_000


@attrs.frozen(kw_only=True)
class LoadLevel:
    """One measured load level (Rule 1). ``kind`` is ``closed`` (``level`` = concurrency),
    ``open`` (``level`` = requests/s, Poisson) or ``batched`` (``level`` = requests, all
    sent at once). Latencies in seconds, throughput in output tokens/s."""

    source: str
    kind: str
    level: float
    prompt_tokens: int
    output_tokens: int
    requests: int | None = None
    ttft: float | None = None
    tpot: float | None = None
    #: the median inter-token latency (every gap of every stream pooled: ``sim.itl``)
    itl: float | None = None
    throughput: float | None = None
    #: Closed loop: the users' first requests are spread uniformly over this many seconds
    #: (see :func:`start_spread`); 0: all at once.
    start_spread: float = 0.0
    #: Closed loop of identical requests (fixed lengths, every output to its limit), all
    #: users starting at one instant (``vllm bench serve --max-concurrency``): the users
    #: finish together and start again together, so the run is its waves, never a steady
    #: state. Re-simulated as measured: no start spread, its own request count.
    lock_step: bool = False

    def measured(self) -> dict[str, float]:
        out = {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "throughput": self.throughput}
        return {k: v for k, v in out.items() if v is not None}


@attrs.frozen
class StepSample:
    """One measured step (the step table's coordinates and its duration)."""

    source: str
    batch_size: float
    prefill_tokens: float
    context_tokens: float
    step_seconds: float


@attrs.frozen
class Measurements:
    levels: tuple[LoadLevel, ...] = ()
    steps: tuple[StepSample, ...] = ()


def _get(doc: Any, path: str, where: str) -> Any:
    """``doc[a][b]...`` for ``path = "a.b"``; ConfigError naming the key if absent."""
    value = doc
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise ConfigError(f"{where}: {path}: missing")
        value = value[part]
    return value


def _opt(doc: Any, path: str) -> Any:
    value = doc
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _positive(
    value: Any,
    where: str,
    key: str,
    *,
    allow_none: bool = False,
    maximum: float | None = None,
) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key}: must be a number, got {value!r}")
    if (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
        raise ConfigError(f"{where}: {key}: must be a number > 0, got {value!r}")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}: {key}: must be at most {maximum:,g}, got {shown}")
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range
        raise ConfigError(f"{where}: {key}: must be a finite number, got {shown}") from None


def _users(value: Any, where: str, key: str) -> float:
    """A closed loop's concurrency (at most :data:`MAX_USERS`)."""
    number = _positive(value, where, key, maximum=MAX_USERS)
    assert number is not None
    return number


def _rate(value: Any, where: str, key: str) -> float:
    """An open loop's rate (at most :data:`MAX_RATE`)."""
    number = _positive(value, where, key, maximum=MAX_RATE)
    assert number is not None
    return number


def _length(value: Any, where: str, key: str) -> int:
    number = _positive(value, where, key, maximum=MAX_TOKENS)
    assert number is not None
    return max(1, round(number))


def _seconds(metric: Any, where: str, key: str) -> float | None:
    """An aiperf metric ``{unit, avg}`` in seconds (None if the file lacks it)."""
    if metric is None:
        return None
    unit = _get(metric, "unit", f"{where}: {key}")
    if unit not in _TIME_UNITS:
        raise ConfigError(f"{where}: {key}.unit: must be a time unit (ms, s, ...), got {unit!r}")
    avg = _positive(_get(metric, "avg", f"{where}: {key}"), where, f"{key}.avg")
    assert avg is not None
    return avg * _TIME_UNITS[unit]


def _check_model(doc_model: Any, model: str | None, where: str, key: str) -> None:
    if model is not None and isinstance(doc_model, str) and doc_model and doc_model != model:
        raise ConfigError(
            f"{where}: {key}: measured model {doc_model!r} is not the config's model {model!r}"
        )


# ---------------------------------------------------------------------------------------
# the formats


def _from_load(doc: Mapping[str, Any], where: str, model: str | None) -> list[LoadLevel]:
    """An ``inference-lab load -o`` document (client/report.py: ``config`` and
    ``summary``, seconds)."""
    _check_model(_opt(doc, "config.model"), model, where, "config.model")
    mode = _get(doc, "summary.mode", where)
    if mode == "closed":
        kind, level = (
            "closed",
            _users(_get(doc, "config.concurrency", where), where, "config.concurrency"),
        )
    elif mode == "open":
        kind, level = "open", _rate(_get(doc, "config.rate", where), where, "config.rate")
    else:
        raise ConfigError(
            f"{where}: summary.mode: an {mode!r} run has no fixed load level; calibrate "
            "from closed-loop (--concurrency) or open-loop (--rate) runs"
        )
    assert level is not None
    prompt = _opt(doc, "summary.prompt_tokens_mean")
    if prompt is None:
        prompt = _get(doc, "config.prompt_tokens", where)
    output = _opt(doc, "summary.completion_tokens_mean")
    if output is None:
        output = _get(doc, "config.max_tokens", where)
    return [
        LoadLevel(
            source=where,
            kind=kind,
            level=level,
            prompt_tokens=_length(prompt, where, "summary.prompt_tokens_mean"),
            output_tokens=_length(output, where, "summary.completion_tokens_mean"),
            requests=int(
                _positive(_get(doc, "summary.requests", where), where, "summary.requests") or 0
            ),
            ttft=_positive(
                _opt(doc, "summary.ttft.mean"), where, "summary.ttft.mean", allow_none=True
            ),
            tpot=_positive(
                _opt(doc, "summary.tpot.mean"), where, "summary.tpot.mean", allow_none=True
            ),
            # the load client pools every gap between a request's tokens, as sim.itl does
            itl=_positive(_opt(doc, "summary.itl.p50"), where, "summary.itl.p50", allow_none=True),
            throughput=_positive(
                _opt(doc, "summary.output_token_throughput"),
                where,
                "summary.output_token_throughput",
                allow_none=True,
            ),
        )
    ]


def _from_aiperf(doc: Mapping[str, Any], where: str, model: str | None) -> list[LoadLevel]:
    """An aiperf ``profile_export_aiperf.json`` (aiperf/exporters/json_exporter.py: each
    metric ``{unit, avg, p50, ...}`` at the top level, the run's settings in
    ``input_config``)."""
    names = _opt(doc, "input_config.endpoint.model_names")
    if isinstance(names, list) and names:
        _check_model(names[0], model, where, "input_config.endpoint.model_names")
    concurrency = _opt(doc, "input_config.loadgen.concurrency")
    rate = _opt(doc, "input_config.loadgen.request_rate")
    if rate is not None:
        kind, level = "open", _rate(rate, where, "input_config.loadgen.request_rate")
    elif concurrency is not None:
        kind, level = "closed", _users(concurrency, where, "input_config.loadgen.concurrency")
    else:
        raise ConfigError(
            f"{where}: input_config.loadgen: neither concurrency nor request_rate is set"
        )
    assert level is not None
    tpot_metric = doc.get("inter_token_latency")
    tpot_key = "inter_token_latency"
    throughput = doc.get("output_token_throughput")
    count = _opt(doc, "request_count.avg")
    return [
        LoadLevel(
            source=where,
            kind=kind,
            level=level,
            prompt_tokens=_length(
                _get(doc, "input_sequence_length.avg", where), where, "input_sequence_length.avg"
            ),
            output_tokens=_length(
                _get(doc, "output_sequence_length.avg", where), where, "output_sequence_length.avg"
            ),
            requests=None if count is None else _length(count, where, "request_count.avg"),
            ttft=_seconds(doc.get("time_to_first_token"), where, "time_to_first_token"),
            tpot=_seconds(tpot_metric, where, tpot_key),
            throughput=None
            if throughput is None
            else _positive(
                _get(throughput, "avg", f"{where}: output_token_throughput"),
                where,
                "output_token_throughput.avg",
            ),
        )
    ]


def _from_guidellm(doc: Mapping[str, Any], where: str, model: str | None) -> list[LoadLevel]:
    """A guidellm ``benchmarks.json`` (guidellm/benchmark/output.py: ``benchmarks``, each
    with ``args.strategy`` and ``metrics.<name>.successful.mean``; milliseconds where the
    name says ``_ms``)."""
    benchmarks = doc["benchmarks"]
    if not isinstance(benchmarks, list) or not benchmarks:
        raise ConfigError(f"{where}: benchmarks: must be a non-empty list")
    levels = []
    for i, bench in enumerate(benchmarks):
        key = f"benchmarks[{i}]"
        here = f"{where}: {key}"
        _check_model(
            _opt(bench, "worker.backend_model"), model, where, f"{key}.worker.backend_model"
        )
        strategy = _get(bench, "args.strategy", here)
        kind_name = _get(strategy, "type_", f"{here}.args.strategy")
        level: float | None
        if kind_name == "synchronous":
            kind, level = "closed", 1.0
        elif kind_name == "concurrent":
            kind = "closed"
            level = _users(_get(strategy, "streams", here), where, f"{key}.args.strategy.streams")
        elif kind_name in ("constant", "poisson"):
            kind = "open"
            level = _rate(_get(strategy, "rate", here), where, f"{key}.args.strategy.rate")
        else:
            raise ConfigError(
                f"{where}: {key}.args.strategy.type_: a {kind_name!r} benchmark has no fixed "
                "load level; calibrate from synchronous, concurrent, constant or poisson ones"
            )
        assert level is not None

        def mean(name: str, *, _bench: Any = bench, _key: str = key) -> float | None:
            value = _opt(_bench, f"metrics.{name}.successful.mean")
            return _positive(
                value, where, f"{_key}.metrics.{name}.successful.mean", allow_none=True
            )

        prompt, output = mean("prompt_token_count"), mean("output_token_count")
        if prompt is None or output is None:
            raise ConfigError(
                f"{where}: {key}.metrics: prompt_token_count and output_token_count are needed"
            )
        for name, value in (("prompt_token_count", prompt), ("output_token_count", output)):
            _length(value, where, f"{key}.metrics.{name}.successful.mean")
        ttft, tpot = mean("time_to_first_token_ms"), mean("time_per_output_token_ms")
        count = _opt(bench, "metrics.request_latency.successful.count")
        levels.append(
            LoadLevel(
                source=f"{where}: {key}",
                kind=kind,
                level=level,
                prompt_tokens=max(1, round(prompt)),
                output_tokens=max(1, round(output)),
                requests=count if isinstance(count, int) and count > 0 else None,
                ttft=None if ttft is None else ttft / 1e3,
                tpot=None if tpot is None else tpot / 1e3,
                throughput=mean("output_tokens_per_second"),
            )
        )
    return levels


def start_spread(level: LoadLevel) -> LoadLevel:
    """``level`` with its users' starts spread over one measured request, ``TTFT +
    (output − 1) · TPOT`` (when both were measured): a closed loop of identical requests
    measured over a run is in its steady state, its requests at every phase, not the
    lock-step of users that all started at one instant (which would put every prefill in
    the same steps). A ``lock_step`` run keeps its users' common start."""
    if level.kind != "closed" or level.ttft is None or level.tpot is None or level.lock_step:
        return level
    return attrs.evolve(level, start_spread=level.ttft + (level.output_tokens - 1) * level.tpot)


def _from_json(doc: Any, where: str, model: str | None) -> list[LoadLevel]:
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: must be a JSON object, got {type(doc).__name__}")
    if "summary" in doc and "config" in doc:
        return _from_load(doc, where, model)
    if "benchmarks" in doc:
        return _from_guidellm(doc, where, model)
    if "time_to_first_token" in doc or "input_config" in doc:
        return _from_aiperf(doc, where, model)
    raise ConfigError(
        f"{where}: not an inference-lab load, aiperf (profile_export_aiperf.json) or "
        "guidellm (benchmarks.json) export"
    )


def read_measurements(paths: list[Path], model: str | None = None) -> Measurements:
    """Read every file (Rule 2 for errors). ``model``: the config's model name; a file
    that names another model is refused."""
    levels: list[LoadLevel] = []
    steps: list[StepSample] = []
    for path in paths:
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file") from None
        except IsADirectoryError:
            raise ConfigError(f"{where}: is a directory, expected a measurement file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read: {exc}") from None
        if text.lstrip().startswith(("{", "[")):
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{where}:{exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})"
                ) from None
            except RecursionError:
                raise ConfigError(f"{where}: invalid JSON: nested too deep") from None
            levels.extend(start_spread(level) for level in _from_json(doc, where, model))
        else:
            steps.extend(
                StepSample(where, b, p, c, s) for b, p, c, s, _line in parse_step_rows(text, where)
            )
    return Measurements(levels=tuple(levels), steps=tuple(steps))
