"""``GET /metrics``: the Prometheus side of the serve app.

Each served model gets a :class:`ModelMetrics`, the :class:`RuntimeObserver` of its runtime;
:class:`ServeMetrics` holds them and the app's own ``prometheus_client`` registry (never the
process-global one: a process may hold several apps, tests do).

Rule 1: the engine task only counts. ``ModelMetrics.on_step`` does O(1) work per engine
        event (a step, a finished request): integer and float additions and a bisection
        into a short tuple. Nothing is formatted, locked or exported there.
Rule 2: everything else happens at scrape time, on the scraping request's task: gauges come
        from the runtime's published :class:`RuntimeSnapshot` and the engine's statistics,
        counters and histograms from the :class:`ModelMetrics`. Every value is read at
        one instant; the exposition is ``prometheus_client``'s (metric families from a
        custom collector, encoded by its ``generate_latest`` one family at a time, with a
        checkpoint in between so that a scrape never holds up the pacer for long).
Rule 3: names, types, labels and histogram buckets are vLLM's (``vllm:*``, labels
        ``model_name`` and ``engine``: our workers are vLLM's engine cores,
        :mod:`inference_lab.serve.engine_series`); the latency histograms carry the
        engine's simulated times (``Finished``), i.e. the model's prediction, not times
        measured at the socket. Our own series are ``inference_lab:*``, per model.
Rule 4: a model whose engine stopped reports nothing running, waiting or cached (its
        gauges are 0, ``inference_lab:engine_alive`` is 0); its counters keep their values.
        A sleeping model's ``vllm:engine_sleep_state`` names its level.
Rule 5: with fine buckets (``--fine-latency-buckets``) the TTFT, ITL / TPOT, E2E and queue
        histograms have every one of vLLM's bounds plus finer ones below: a query written
        for vLLM's buckets still finds each of its ``le`` values, and
        ``histogram_quantile`` reads millisecond latencies instead of interpolating inside
        vLLM's first bucket.
Rule 6: the prefix cache is exported as vLLM exports it, per engine core: our replicas
        are vLLM's data-parallel engines (label ``engine``, the replica's index).
        ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` count tokens (the
        engine's own counters); ``vllm:cache_config_info`` is a gauge at 1 whose labels
        carry the cache's configuration (``block_size``, ``num_gpu_blocks``,
        ``enable_prefix_caching``, ``gpu_memory_utilization``, written as vLLM writes
        them: ``str()`` of the value).
Rule 7: a speculative model exports vLLM's speculative-decoding counters, per engine as
        vLLM does (labels ``model_name``, ``engine``): ``vllm:spec_decode_num_drafts``,
        ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
        ``..._num_accepted_tokens_per_pos`` (label ``position``), counted when a step's
        batch is chosen (its acceptance is drawn then). A lockstep step of data-parallel
        attention ranks counts under its first rank. Other models export none of them.
Rule 8: a server that is data-parallel rank ``r`` (``serve --data-parallel-size``,
        ``serve/ranks.py``) numbers its engines as vLLM's rank ``r`` does: every
        ``engine`` label is offset by ``r`` x the model's workers (rank ``r`` of a
        one-replica model: ``engine="r"``), at encoding time.
Rule 9: prefill/decode hand-offs (``serve --role``) are exported under
        ``inference_lab:kv_*`` by servers of role ``prefill`` (held KV, claims) and
        ``decode`` (claims and releases, the transfers its engine received):
        ``serve/kv_metrics.py``, through :attr:`ServeMetrics.extra`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Literal

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from inference_lab.core.engine import EngineStatistics, Finished, StepEvents
from inference_lab.runtime.model_runtime import ModelRuntime, RuntimeSnapshot
from inference_lab.serve.engine_series import SLEEP_STATES, EngineSeries, engine_families
from inference_lab.serve.feature_metrics import (
    MODEL_LABEL,
    prefix_cache_families,
    speculative_families,
    tier_families,
)
from inference_lab.serve.lora import lora_info_family

__all__ = [
    "E2E_BUCKETS",
    "FINE_E2E_BUCKETS",
    "FINE_ITL_BUCKETS",
    "FINE_TTFT_BUCKETS",
    "ITL_BUCKETS",
    "RECENT_FINISHED",
    "LAG_BUCKETS",
    "TTFT_BUCKETS",
    "ModelMetrics",
    "ServeMetrics",
    "token_buckets",
]

#: vLLM's buckets (``vllm/v1/metrics/loggers.py``): time to first token, ...
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: ... inter-token latency and time per output token, ...
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
#: ... request latencies (end to end, queue), ...
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: Fine buckets (Rule 5): vLLM's bounds and finer ones below them, for simulated speeds
#: (a decode step of a few milliseconds or less). TTFT: ...
FINE_TTFT_BUCKETS = tuple(
    sorted(
        set(TTFT_BUCKETS)
        | {0.00025, 0.0005, 0.00075, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.0075, 0.015, 0.03, 0.05}
    )
)
#: ... ITL / TPOT (vLLM's first bound is 10 ms: a 1.4 ms ITL reads as 5 ms there), ...
FINE_ITL_BUCKETS = tuple(
    sorted(
        set(ITL_BUCKETS)
        | {0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.00175, 0.002}
        | {0.0025, 0.003, 0.0035, 0.004, 0.005, 0.0075}
    )
)
#: ... and E2E and queue time (vLLM's first bound is 300 ms).
FINE_E2E_BUCKETS = tuple(
    sorted(
        set(E2E_BUCKETS)
        | {0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175}
        | {0.2, 0.225, 0.25, 0.275, 0.35, 0.4, 0.45, 0.6, 0.7}
    )
)
#: ... and tokens per engine step.
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Pacing lag (ours): how late the engine task handled an engine event, in seconds.
LAG_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip

Reason = Literal["queue_saturated", "engine_unavailable", "engine_sleeping"]
REJECT_REASONS: tuple[Reason, ...] = ("queue_saturated", "engine_unavailable", "engine_sleeping")
_LABEL = MODEL_LABEL
#: Finished requests kept for the dashboard's latency window (``serve/dashboard.py``).
RECENT_FINISHED = 8192


def token_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``
    (the buckets of its token-count histograms, bounded by the model's context)."""
    buckets: list[int] = []
    exponent = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent *= 10


class Histogram:
    """Bucket counts and a sum, for one model's series: :meth:`observe` is the engine
    task's O(log buckets) update; :meth:`buckets` the cumulative view for exposition."""

    __slots__ = ("bounds", "counts", "labels", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        # the ``le`` labels as prometheus_client writes them ("0.001", "1.0", ...)
        self.labels = tuple(floatToGoString(b) for b in self.bounds)  # type: ignore[no-untyped-call]

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (Prometheus buckets are ``le``)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.total += value * count

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for label, count in zip(self.labels, self.counts, strict=False):
            running += count
            out.append((label, running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class ModelMetrics:
    """One model's counters and histograms, fed by its runtime (the runtime's observer)
    and read at scrape time: vLLM's per engine (:class:`EngineSeries`, one per worker),
    ours per model. Created by :class:`ServeMetrics`."""

    def __init__(self, runtime: ModelRuntime, *, fine_buckets: bool = False) -> None:
        self.runtime = runtime
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        tokens = token_buckets(runtime.deployment.model.max_seq_len)
        self.engines = tuple(
            EngineSeries(
                Histogram,
                ttft=FINE_TTFT_BUCKETS if fine_buckets else TTFT_BUCKETS,
                itl=FINE_ITL_BUCKETS if fine_buckets else ITL_BUCKETS,
                latency=FINE_E2E_BUCKETS if fine_buckets else E2E_BUCKETS,
                tokens=tokens,
                iteration=ITERATION_BUCKETS,
            )
            for _ in range(runtime.deployment.workers)
        )
        self.lag = Histogram(LAG_BUCKETS)
        # For the dashboard's sampler (serve/dashboard.py), which reads them between steps:
        #: the newest finished requests as (finish, TTFT, E2E) in engine seconds ...
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=RECENT_FINISHED)
        #: ... how many requests finished in all, ...
        self.finished = 0
        #: ... tokens emitted (a request of n > 1 choices: its other n - 1 choices' tokens
        #: are added when it finishes), ...
        self.tokens_emitted = 0
        #: ... engine events handled, and the largest lag since the sampler last reset it.
        self.lag_events = 0
        self.lag_peak = 0.0
        #: Speculative decoding (Rule 7): per engine, drafts, draft tokens, accepted tokens
        #: and accepted tokens per position; None for a model that does not speculate.
        spec = runtime.deployment.speculative
        self.spec: dict[int, list[int]] | None = None
        self.spec_positions = 0
        if spec is not None:
            self.spec_positions = spec.num_speculative_tokens
            self.spec = {
                w: [0, 0, 0] + [0] * spec.num_speculative_tokens
                for w in range(runtime.deployment.workers)
            }

    # -- the engine task (RuntimeObserver) ---------------------------------------------
    def on_step(self, events: StepEvents, lag: float | None) -> None:
        if lag is not None:  # (None: an event no client sees, runtime Rule 2)
            self.lag.observe(lag)
            self.lag_events += 1
            if lag > self.lag_peak:
                self.lag_peak = lag
        step = events.step
        if self.spec is None:
            # a request emits at most one token per sequence per step: one entry each
            self.tokens_emitted += len(events.tokens)
        else:  # a verify step emits several (Rule 7)
            self.tokens_emitted += sum([count for _, count in events.tokens])
            if step is not None and step.drafts:
                row = self.spec[step.worker]
                row[0] += step.drafts
                row[1] += step.draft_tokens
                row[2] += step.accepted_tokens
                for j, count in enumerate(step.accepted_per_position):
                    row[3 + j] += count
        if step is not None:
            engine = self.engines[step.worker]
            engine.iteration.observe(step.num_tokens)
            engine.preemptions += step.preempted
        for finished in events.finished:
            self._finished(finished)

    def _finished(self, f: Finished) -> None:
        self.engines[f.worker].finished(f)
        self.finished += 1
        self.recent.append(
            (f.finish_time, f.first_token_time - f.arrival_time, f.finish_time - f.arrival_time)
        )
        if f.n > 1:
            self.tokens_emitted += (f.n - 1) * f.output_tokens

    def on_finished_request(self, finished: Finished, max_tokens: int) -> None:
        self.engines[finished.worker].max_tokens_hist.observe(max_tokens)

    def on_aborted(self, worker: int) -> None:
        self.engines[worker].success["abort"] += 1

    # -- the HTTP side -------------------------------------------------------------------
    def on_refused(self, reason: Reason) -> None:
        self.rejected[reason] += 1


def _histogram(
    name: str, documentation: str, models: Iterator[tuple[str, Histogram]]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=_LABEL)
    for model, hist in models:
        family.add_metric([model], hist.buckets(), hist.total)
    return family


Row = tuple[str, "ModelMetrics", RuntimeSnapshot, EngineStatistics | None]


def _engine_gauges(rows: list[Row]) -> Iterator[Metric]:
    """Rule 4's per-engine gauges: running and waiting requests, KV usage, sleep state
    (all 0 for a stopped engine, and awake)."""
    labels = [*_LABEL, "engine"]
    running = GaugeMetricFamily(
        "vllm:num_requests_running", "Number of requests in model execution batches.", labels=labels
    )
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=labels
    )
    usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
    )
    old_usage = GaugeMetricFamily(
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage. "
        "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        labels=labels,
    )
    sleep = GaugeMetricFamily(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
        "level 2.",
        labels=[*labels, "sleep_state"],
    )
    for name, m, _snap, eng in rows:
        runtime = m.runtime
        pending = runtime.pending_by_worker() if eng is not None else []
        level = runtime.sleep_level
        for w in range(runtime.deployment.workers):
            engine = str(w)
            if eng is not None:
                ws = eng.workers[w]
                kv = ws.kv_used_blocks / ws.kv_total_blocks if ws.kv_total_blocks else 0.0
                values = (ws.running, ws.waiting + pending[w], kv)
            else:
                values = (0, 0, 0.0)
            running.add_metric([name, engine], values[0])
            waiting.add_metric([name, engine], values[1])
            usage.add_metric([name, engine], values[2])
            old_usage.add_metric([name, engine], values[2])
            for i, state in enumerate(SLEEP_STATES):
                sleep.add_metric([name, engine, state], 1.0 if level == i else 0.0)
    yield from (running, waiting, usage, old_usage, sleep)


class _Collector:
    """The app's metric families, built from live state on each scrape (Rule 2)."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        models = self.metrics.models
        rows: list[Row] = []
        for name, m in models.items():
            snap = m.runtime.snapshot()
            rows.append((name, m, snap, m.runtime.engine.statistics() if snap.alive else None))

        def gauge(name: str, documentation: str, values: list[float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=_LABEL)
            for row, value in zip(rows, values, strict=True):
                family.add_metric([row[0]], value)
            return family

        yield from _engine_gauges(rows)
        yield gauge(
            "inference_lab:waiting_places",
            "Queued requests holding waiting places rather than seats in the batch: what "
            "max_waiting bounds.",
            [snap.depth for _, _, snap, _ in rows],
        )
        yield from engine_families([(name, m.engines) for name, m, _, _ in rows])
        yield from prefix_cache_families(rows)
        yield from tier_families(rows)
        yield from speculative_families(rows)
        yield from lora_info_family(m.runtime for _, m, _, _ in rows)
        rejected = CounterMetricFamily(
            "inference_lab:requests_rejected",
            "Requests refused before admission: 529 queue_saturated, 503 engine_unavailable "
            "or engine_sleeping.",
            labels=[*_LABEL, "reason"],
        )
        for name, m, _, _ in rows:
            for reason, count in m.rejected.items():
                rejected.add_metric([name, reason], count)
        yield rejected
        yield gauge(
            "inference_lab:max_waiting",
            "The bound on inference_lab:waiting_places (0 = unbounded).",
            [snap.max_waiting for _, _, snap, _ in rows],
        )
        yield gauge(
            "inference_lab:max_num_seqs",
            "The cap on running sequences per worker.",
            [snap.max_num_seqs for _, _, snap, _ in rows],
        )
        yield gauge(
            "inference_lab:engine_alive",
            "1 while the model's engine task runs, 0 once it stopped or failed.",
            [1.0 if snap.alive else 0.0 for _, _, snap, _ in rows],
        )
        yield _histogram(
            "inference_lab:pacing_lag_seconds",
            "How late the engine task handled each engine event, in wall-clock seconds.",
            ((name, m.lag) for name, m, _, _ in rows),
        )
        for extra in self.metrics.extra:
            yield from extra()


def _offset_engines(family: Metric, offsets: Mapping[str, int]) -> None:
    """Rule 8: add the model's offset to every ``engine`` label of ``family``."""
    samples = []
    for sample in family.samples:
        labels = sample.labels
        if "engine" in labels:
            offset = offsets.get(labels.get("model_name", ""), 0)
            labels = {**labels, "engine": str(int(labels["engine"]) + offset)}
        samples.append(sample._replace(labels=labels))
    family.samples = samples


class _Family(Collector):
    """One collected metric family, as the registry ``generate_latest`` encodes."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


class ServeMetrics:
    """The metrics of one app: a :class:`ModelMetrics` per runtime (installed as its
    observer) and the registry ``GET /metrics`` exports. Built by ``ServeState.build``."""

    def __init__(
        self, runtimes: Mapping[str, ModelRuntime], *, fine_buckets: bool = False, rank: int = 0
    ) -> None:
        self.models: dict[str, ModelMetrics] = {}
        #: Model name -> what its ``engine`` labels are offset by (Rule 8): data-parallel
        #: rank x workers; empty for rank 0.
        self.engine_offsets = {
            name: rank * r.deployment.workers for name, r in runtimes.items() if rank
        }
        for name, runtime in runtimes.items():
            metrics = ModelMetrics(runtime, fine_buckets=fine_buckets)
            runtime.observer = metrics
            self.models[name] = metrics
        #: More metric families, built at each scrape (the app's prefill/decode part:
        #: ``serve/kv_metrics.py``).
        self.extra: list[Callable[[], Iterable[Metric]]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    async def exposition(self) -> tuple[bytes, str]:
        """The body and content type of a scrape (Rule 2): every value is read at one
        instant, synchronously; then each family is encoded by ``generate_latest`` with a
        checkpoint in between, so a scrape never holds the event loop (the pacer, the
        stream writers) for more than one family's encoding.

        Always the Prometheus text format 0.0.4, which every scraper accepts. Not
        negotiated: prometheus_client's OpenMetrics encoder (chosen for Prometheus's
        default ``Accept``) writes ``vllm:x`` samples as ``vllm_x`` under
        ``# TYPE vllm:x`` (prometheus/client_python#1177)."""
        parts = []
        for family in list(self.registry.collect()):
            if self.engine_offsets:
                _offset_engines(family, self.engine_offsets)
            parts.append(generate_latest(_Family(family)))
            await trio.lowlevel.checkpoint()
        return b"".join(parts), CONTENT_TYPE_PLAIN_0_0_4
