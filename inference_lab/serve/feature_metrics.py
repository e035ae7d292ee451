"""``/metrics``' families of the engine's features, per replica: the prefix cache (metrics
Rule 6), the KV tiers behind HBM and speculative decoding, built at each scrape from the
rows :class:`~inference_lab.serve.metrics.ServeMetrics` collects (one per model: its
name, its :class:`~inference_lab.serve.metrics.ModelMetrics`, the runtime's snapshot and
the engine's statistics)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inference_lab.core.engine import EngineStatistics
from inference_lab.runtime.model_runtime import ModelRuntime, RuntimeSnapshot

__all__ = ["MODEL_LABEL", "prefix_cache_families", "speculative_families", "tier_families"]

#: The label every family has: the served model's name.
MODEL_LABEL = ["model_name"]


class ModelMetrics(Protocol):
    """What these families read of :class:`inference_lab.serve.metrics.ModelMetrics`."""

    runtime: ModelRuntime
    #: The speculative counters per worker (None: not a speculative model).
    spec: dict[int, list[int]] | None
    spec_positions: int


def prefix_cache_families(
    rows: Sequence[tuple[str, ModelMetrics, RuntimeSnapshot, EngineStatistics | None]],
) -> Iterator[Metric]:
    """Rule 6: the prefix-cache counters and the cache's configuration, per replica."""
    labels = [*MODEL_LABEL, "engine"]
    queries = CounterMetricFamily(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        labels=labels,
    )
    info_labels = [
        *labels,
        "block_size",
        "num_gpu_blocks",
        "enable_prefix_caching",
        "gpu_memory_utilization",
    ]
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels
    )
    for name, m, _, _ in rows:
        # the engine's counters, alive or not (Rule 4: counters keep their values)
        stats = m.runtime.engine.statistics()
        sched = m.runtime.deployment.scheduler
        for engine, w in enumerate(stats.workers):
            queries.add_metric([name, str(engine)], w.prefix_cache_queries)
            hits.add_metric([name, str(engine)], w.prefix_cache_hits)
            info.add_metric(
                [
                    name,
                    str(engine),
                    str(sched.block_size),
                    str(w.kv_total_blocks),
                    str(sched.enable_prefix_caching),
                    str(sched.gpu_memory_utilization),
                ],
                1.0,
            )
    yield queries
    yield hits
    yield info


def tier_families(
    rows: Sequence[tuple[str, ModelMetrics, RuntimeSnapshot, EngineStatistics | None]],
) -> Iterator[Metric]:
    """Rule 6: the KV tiers behind HBM (docs/kv-tiers.md), per replica, for the models
    that have them: vLLM's external prefix-cache and offload counters, and the tiers' own
    gauges."""
    labels = [*MODEL_LABEL, "engine"]
    tiered = [
        (name, m) for name, m, _, _ in rows if m.runtime.deployment.scheduler.kv_offloading_size
    ]
    if not tiered:
        return
    queries = CounterMetricFamily(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in "
        "terms of number of queried tokens.",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
        "of number of cached tokens.",
        labels=labels,
    )
    moved = CounterMetricFamily(
        "vllm:kv_offload_total_bytes",
        "Bytes moved between HBM and the offloading tiers.",
        labels=[*labels, "transfer_type"],
    )
    took = CounterMetricFamily(
        "vllm:kv_offload_total_time",
        "Seconds spent loading KV blocks from the offloading tiers.",
        labels=[*labels, "transfer_type"],
    )
    held = GaugeMetricFamily(
        "inference_lab:kv_tier_blocks",
        "KV blocks held in a tier behind HBM.",
        labels=[*labels, "tier"],
    )
    recomputed = CounterMetricFamily(
        "inference_lab:kv_tier_recomputed_tokens",
        "Prompt tokens found in a tier but computed, because computing them was cheaper.",
        labels=labels,
    )
    for name, m in tiered:
        dep = m.runtime.deployment
        for engine, w in enumerate(m.runtime.engine.statistics().workers):
            t = w.tiers
            if t is None:
                continue
            key = [name, str(engine)]
            queries.add_metric(key, w.prefix_cache_queries - w.prefix_cache_hits)
            hits.add_metric(key, t.host_hit_tokens + t.disk_hit_tokens)
            stored = (t.host_stores + t.disk_stores) * dep.block_bytes
            moved.add_metric([*key, "GPU_to_CPU"], stored)
            moved.add_metric([*key, "CPU_to_GPU"], t.fetch_bytes)
            took.add_metric([*key, "CPU_to_GPU"], t.fetch_seconds)
            held.add_metric([*key, "host"], t.host_blocks)
            held.add_metric([*key, "disk"], t.disk_blocks)
            recomputed.add_metric(key, t.recomputed_tokens)
    yield from (queries, hits, moved, took, held, recomputed)


def speculative_families(
    rows: Sequence[tuple[str, ModelMetrics, RuntimeSnapshot, EngineStatistics | None]],
) -> Iterator[Metric]:
    """Rule 7: vLLM's speculative-decoding counters, for the models that speculate."""
    spec = [(name, m, m.spec) for name, m, _, _ in rows if m.spec is not None]
    if not spec:
        return
    labels = [*MODEL_LABEL, "engine"]
    families = [
        CounterMetricFamily(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels=labels
        ),
        CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels=labels
        ),
        CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels=labels
        ),
    ]
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*labels, "position"],
    )
    for name, m, counts in spec:
        for engine, row in counts.items():
            for i, family in enumerate(families):
                family.add_metric([name, str(engine)], row[i])
            for j in range(m.spec_positions):
                per_pos.add_metric([name, str(engine), str(j)], row[3 + j])
    yield from families
    yield per_pos
