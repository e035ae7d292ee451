"""vLLM's current ``/metrics`` set, per engine (``serve/engine_series.py``): every series
carries ``engine``, the per-engine values add up to the model's traffic, and the
families vLLM added (a request's time per output token, the prefill / decode / inference
times, ``request_params_*``, prompt tokens by source, the sleep state) have the values
the engine's own ``Finished`` records give. Scrapes are parsed by ``prometheus_client``."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from inference_lab.core.engine import Finished
from tests.conftest import GPT, ServeFactory, chat_body, make_settings


async def scrape(s: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await s.client.get("/metrics")
    out = {}
    for family in text_string_to_metric_families((await response.get_data()).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def at(samples: Any, name: str, engine: str = "0", **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": GPT, "engine": engine, **labels}.items())))
    return float(samples[key])


def total(samples: Any, name: str, **labels: str) -> float:
    """A series summed over its engines."""
    out = 0.0
    for (sample, pairs), v in samples.items():
        d = dict(pairs)
        if sample == name and all(d.get(k) == x for k, x in labels.items()):
            out += v
    return out


class Recorder:
    """Wraps a runtime's observer to keep every ``Finished`` (for exact expectations)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.finished: list[Finished] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def on_step(self, events: Any, lag: float | None) -> None:
        self.finished.extend(events.finished)
        self.inner.on_step(events, lag)


async def test_every_vllm_series_is_per_engine_and_adds_up(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Two replicas: each has its own series (engine 0 and 1); summed they are the
    model's totals; gauges and the sleep state exist per engine."""
    settings = make_settings()
    dep = settings.deployments[0]
    two = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, replicas=2))
    async with serve(attrs.evolve(settings, deployments=(two,))) as s:
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(s.post, "/v1/chat/completions", chat_body(f"q{i}", max_tokens=5))
        samples = await scrape(s)
    for engine in ("0", "1"):
        assert at(samples, "vllm:request_success_total", engine, finished_reason="length") > 0
        assert at(samples, "vllm:num_requests_running", engine) == 0
        assert at(samples, "vllm:engine_sleep_state", engine, sleep_state="awake") == 1
    assert total(samples, "vllm:request_success_total", finished_reason="length") == 6
    assert total(samples, "vllm:generation_tokens_total") == 30
    assert total(samples, "vllm:request_generation_tokens_count") == 6


async def test_vllms_request_phase_histograms_follow_the_engines_records(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Each finished request observes vLLM's definitions on its simulated times: queue,
    prefill (first token - first scheduled), decode (finish - first token), inference
    (finish - first scheduled), its own time per output token (decode / (tokens - 1),
    requests of two or more tokens), ``n``, ``max_tokens``, and its prompt split into
    computed and cached tokens."""
    prompt = "The same long prefix. " * 40
    async with serve() as s:
        recorder = Recorder(s.runtime().observer)
        s.runtime().observer = recorder
        bodies = [
            chat_body(prompt + "a", max_tokens=7),
            chat_body(prompt + "b", max_tokens=1),
            {**chat_body(prompt + "c", max_tokens=4), "n": 3},
        ]
        for body in bodies:
            response = await s.post("/v1/chat/completions", body)
            assert response.status_code == 200
        samples = await scrape(s)
    done = recorder.finished
    assert len(done) == 3

    def hist_sum(name: str) -> float:
        return at(samples, f"vllm:{name}_sum")

    assert hist_sum("request_prefill_time_seconds") == pytest.approx(
        sum(f.first_token_time - f.first_scheduled_time for f in done), abs=1e-12
    )
    assert hist_sum("request_decode_time_seconds") == pytest.approx(
        sum(f.finish_time - f.first_token_time for f in done), abs=1e-12
    )
    assert hist_sum("request_inference_time_seconds") == pytest.approx(
        sum(f.finish_time - f.first_scheduled_time for f in done), abs=1e-12
    )
    multi = [f for f in done if f.output_tokens > 1]
    assert at(samples, "vllm:request_time_per_output_token_seconds_count") == len(multi) == 2
    assert hist_sum("request_time_per_output_token_seconds") == pytest.approx(
        sum((f.finish_time - f.first_token_time) / (f.output_tokens - 1) for f in multi), abs=1e-12
    )
    assert at(samples, "vllm:request_params_n_sum") == 1 + 1 + 3
    assert at(samples, "vllm:request_params_n_bucket", le="2.0") == 2
    assert at(samples, "vllm:request_params_max_tokens_sum") == 7 + 1 + 4
    assert at(samples, "vllm:request_max_num_generation_tokens_sum") == 7 + 1 + 4
    cached = sum(f.cached_tokens for f in done)
    prompt_total = sum(f.prompt_tokens for f in done)
    assert cached > 0  # the second and third requests share the prefix's blocks
    by_source = "vllm:prompt_tokens_by_source_total"
    assert at(samples, by_source, source="local_cache_hit") == cached
    assert at(samples, by_source, source="local_compute") == prompt_total - cached
    assert at(samples, by_source, source="external_kv_transfer") == 0
    assert at(samples, "vllm:prompt_tokens_cached_total") == cached
    assert hist_sum("request_prefill_kv_computed_tokens") == prompt_total - cached


async def test_the_sleep_state_and_aborts_are_per_engine(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``vllm:engine_sleep_state`` names the level a model sleeps at; a request ended by
    the sleep counts as an ``abort`` of its engine."""
    async with serve() as s:
        async with s.stream(chat_body(max_tokens=500, stream=True)) as stream:
            await stream.next_chunk()
            await s.client.post("/sleep", query_string={"level": 2})
            await stream.read_all()
        asleep = await scrape(s)
        await s.client.post("/wake_up")
        awake = await scrape(s)
        response = await s.post("/v1/chat/completions", chat_body())
        assert json.loads(await response.get_data())["usage"]["completion_tokens"] == 4
    state = "vllm:engine_sleep_state"
    assert [
        at(asleep, state, sleep_state=x) for x in ("awake", "weights_offloaded", "discard_all")
    ] == [0, 0, 1]
    assert [
        at(awake, state, sleep_state=x) for x in ("awake", "weights_offloaded", "discard_all")
    ] == [1, 0, 0]
    assert at(asleep, "vllm:request_success_total", finished_reason="abort") == 1
