"""vLLM's per-engine series on ``/metrics``: what one engine core (here: one worker, a
replica or a data-parallel attention rank) counts, and the families built from it.

vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``) labels every series with
``model_name`` and ``engine`` (the engine core's index); ``docs/gateway.md`` lists each of
its metrics with what it means here, or why it is not exported.

Rule 1: an :class:`EngineSeries` is fed by the runtime's observer on the engine task, in
        O(1) per engine event: a step's tokens and preemptions, and each finished
        request's latencies and counts (``Finished``'s simulated times, vLLM's
        definitions: queue = first scheduled - arrival, prefill = first token - first
        scheduled, decode = finish - first token, inference = finish - first scheduled,
        a request's time per output token = decode / (output tokens - 1)).
Rule 2: every family here has the labels ``model_name`` and ``engine`` and vLLM's name,
        type and buckets (the fine buckets where ``--fine-latency-buckets`` asks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from inference_lab.core.engine import Finished

__all__ = [
    "ENGINE_LABELS",
    "FINISH_REASONS",
    "PROMPT_SOURCES",
    "SLEEP_STATES",
    "EngineSeries",
    "engine_families",
]

#: The labels of every per-engine series (Rule 2).
ENGINE_LABELS = ["model_name", "engine"]
#: Finish reasons exported (at 0) before any request finished with them: vLLM's, with
#: ``abort`` for a request whose client left (or that was cancelled) before it finished.
FINISH_REASONS = ("stop", "length", "abort")
#: ``vllm:prompt_tokens_by_source``'s sources (vLLM's ``PromptTokenStats.ALL_SOURCES``).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``vllm:engine_sleep_state``'s states: awake, asleep at level 1, asleep at level 2.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
#: ``vllm:request_params_n``'s buckets.
N_BUCKETS = (1, 2, 5, 10, 20)


class EngineSeries:
    """One engine's counters and histograms (Rule 1). ``histogram`` builds a histogram of
    the given bounds (``serve.metrics.Histogram``)."""

    def __init__(
        self,
        histogram: Any,
        *,
        ttft: Sequence[float],
        itl: Sequence[float],
        latency: Sequence[float],
        tokens: Sequence[int],
        iteration: Sequence[int],
    ) -> None:
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = histogram(ttft)
        self.itl = histogram(itl)
        self.request_tpot = histogram(itl)
        self.e2e = histogram(latency)
        self.queue = histogram(latency)
        self.prefill = histogram(latency)
        self.decode = histogram(latency)
        self.inference = histogram(latency)
        self.prompt_hist = histogram(tokens)
        self.generation_hist = histogram(tokens)
        self.max_generation_hist = histogram(tokens)
        self.max_tokens_hist = histogram(tokens)
        self.prefill_computed_hist = histogram(tokens)
        self.n_hist = histogram(N_BUCKETS)
        self.iteration = histogram(iteration)

    def finished(self, f: Finished) -> None:
        """A request this engine finished (Rule 1)."""
        generated = f.output_tokens * f.n
        self.prompt_tokens += f.prompt_tokens
        self.cached_prompt_tokens += f.cached_tokens
        self.generation_tokens += generated
        self.success[f.finish_reason] = self.success.get(f.finish_reason, 0) + 1
        self.ttft.observe(f.first_token_time - f.arrival_time)
        self.e2e.observe(f.finish_time - f.arrival_time)
        self.queue.observe(f.first_scheduled_time - f.arrival_time)
        self.prefill.observe(f.first_token_time - f.first_scheduled_time)
        decode = f.finish_time - f.first_token_time
        self.decode.observe(decode)
        self.inference.observe(f.finish_time - f.first_scheduled_time)
        self.prompt_hist.observe(f.prompt_tokens)
        self.generation_hist.observe(generated)
        self.max_generation_hist.observe(f.output_tokens)
        self.prefill_computed_hist.observe(f.prompt_tokens - f.cached_tokens)
        self.n_hist.observe(f.n)
        if f.output_tokens > 1:
            # The engine reports a request's first and last token times, not each token's:
            # its output_tokens - 1 gaps are observed at their mean (sum and count exact).
            gaps = f.output_tokens - 1
            self.itl.observe(decode / gaps, gaps * f.n)
            self.request_tpot.observe(decode / gaps)


def _counter(name: str, documentation: str, rows: Sequence[tuple[str, int, int]]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=ENGINE_LABELS)
    for model, engine, value in rows:
        family.add_metric([model, str(engine)], value)
    return family


#: (name, documentation, EngineSeries attribute) of every per-engine histogram, in
#: exposition order.
HISTOGRAMS = (
    (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds (simulated engine time).",
        "ttft",
    ),
    (
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds (simulated engine time; each "
        "request's gaps at their mean).",
        "itl",
    ),
    (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds. "
        "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        "itl",
    ),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "request_tpot",
    ),
    (
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds (simulated engine time).",
        "e2e",
    ),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request (simulated engine time).",
        "queue",
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "inference",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "prefill",
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        "decode",
    ),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_hist"),
    (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        "generation_hist",
    ),
    (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "max_generation_hist",
    ),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "n_hist"),
    (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        "max_tokens_hist",
    ),
    (
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        "prefill_computed_hist",
    ),
    (
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        "iteration",
    ),
)


def engine_families(models: Sequence[tuple[str, Sequence[EngineSeries]]]) -> Iterator[Metric]:
    """The per-engine counter and histogram families (Rule 2) of ``models``: each model's
    name and its engines' series, engine ``i`` being ``series[i]``."""
    rows = [(name, i, e) for name, engines in models for i, e in enumerate(engines)]
    yield _counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed (of finished requests).",
        [(name, i, e.prompt_tokens) for name, i, e in rows],
    )
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=[*ENGINE_LABELS, "source"],
    )
    for name, i, e in rows:
        counts = (e.prompt_tokens - e.cached_prompt_tokens, e.cached_prompt_tokens, 0)
        for source, count in zip(PROMPT_SOURCES, counts, strict=True):
            by_source.add_metric([name, str(i), source], count)
    yield by_source
    yield _counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        [(name, i, e.cached_prompt_tokens) for name, i, e in rows],
    )
    yield _counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed (of finished requests).",
        [(name, i, e.generation_tokens) for name, i, e in rows],
    )
    yield _counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        [(name, i, e.preemptions) for name, i, e in rows],
    )
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=[*ENGINE_LABELS, "finished_reason"],
    )
    for name, i, e in rows:
        for reason, count in e.success.items():
            success.add_metric([name, str(i), reason], count)
    yield success
    for hist_name, documentation, attr in HISTOGRAMS:
        family = HistogramMetricFamily(hist_name, documentation, labels=ENGINE_LABELS)
        for name, i, e in rows:
            hist = getattr(e, attr)
            family.add_metric([name, str(i)], hist.buckets(), hist.total)
        yield family
