"""``GET /metrics`` (:mod:`inference_lab.serve.metrics`): vLLM's names, types and buckets,
values that match the traffic exactly, and the ``Retry-After`` header. Every scrape is
parsed with ``prometheus_client``'s own parser."""

from __future__ import annotations

import json

import attrs
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from inference_lab.serve import ServeState
from inference_lab.serve.error_replies import RETRY_AFTER_UNAVAILABLE
from inference_lab.serve.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    token_buckets,
)
from tests.conftest import GPT, LLAMA, Served, ServeFactory, Stream, chat_body, make_settings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(s: Served, accept: str | None = None) -> tuple[dict[str, str], Samples]:
    """GET /metrics: the family types by name and every sample by (name, sorted labels)."""
    headers = {"accept": accept} if accept is not None else {}
    response = await s.client.get("/metrics", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = (await response.get_data()).decode()
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, key
            samples[key] = sample.value
    return types, samples


#: Per-model series (ours and vLLM's cache-config families name their engine themselves).
PER_MODEL = "inference_lab:"


def value(samples: Samples, name: str, model: str = GPT, **labels: str) -> float:
    """One sample; a vLLM series is engine 0's unless ``engine`` is given."""
    if not name.startswith(PER_MODEL):
        labels.setdefault("engine", "0")
    key = (name, tuple(sorted({"model_name": model, **labels}.items())))
    return samples[key]


def buckets(samples: Samples, name: str, model: str = GPT) -> dict[str, float]:
    """``le`` -> cumulative count of one model's histogram ``name``."""
    out = {}
    for (sample, labels), count in samples.items():
        d = dict(labels)
        if sample == f"{name}_bucket" and d["model_name"] == model and d.get("engine", "0") == "0":
            out[d["le"]] = count
    return out


# -- names, types, buckets ---------------------------------------------------------------


async def test_every_family_has_vllms_name_and_type_per_model(serve: ServeFactory) -> None:
    """One series per served model (label model_name) for every family of the issue, with
    vLLM's metric types; counters are exposed with their _total suffix."""
    async with serve(make_settings(GPT, LLAMA)) as s:
        types, samples = await scrape(s)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:cache_config_info": "gauge",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:engine_sleep_state": "gauge",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:prompt_tokens_cached": "counter",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:request_prefill_kv_computed_tokens": "histogram",
        "inference_lab:requests_rejected": "counter",
        "inference_lab:waiting_places": "gauge",
        "inference_lab:max_waiting": "gauge",
        "inference_lab:max_num_seqs": "gauge",
        "inference_lab:engine_alive": "gauge",
        "inference_lab:pacing_lag_seconds": "histogram",
    }
    assert types == expected
    for model in (GPT, LLAMA):
        assert value(samples, "vllm:num_requests_running", model) == 0
        assert value(samples, "vllm:prompt_tokens_total", model) == 0
        assert value(samples, "vllm:request_success_total", model, finished_reason="stop") == 0
        assert value(samples, "vllm:request_success_total", model, finished_reason="length") == 0
        assert value(samples, "vllm:request_success_total", model, finished_reason="abort") == 0
        for reason in ("queue_saturated", "engine_unavailable", "engine_sleeping"):
            assert (
                value(samples, "inference_lab:requests_rejected_total", model, reason=reason) == 0
            )
        assert value(samples, "inference_lab:engine_alive", model) == 1


async def test_histograms_use_vllms_bucket_boundaries(serve: ServeFactory) -> None:
    """TTFT, ITL / TPOT, E2E / queue and per-step tokens use vLLM's boundaries; the token
    histograms vLLM's 1-2-5 series up to the model's context length."""
    async with serve() as s:
        _, samples = await scrape(s)
        max_len = s.runtime().deployment.model.max_seq_len

    def bounds(name: str) -> list[float]:
        les = buckets(samples, name)
        assert list(les)[-1] == "+Inf"
        return [float(le) for le in les if le != "+Inf"]

    assert bounds("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert len(TTFT_BUCKETS) == 22 and TTFT_BUCKETS[-1] == 2560.0
    assert bounds("vllm:inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert bounds("vllm:time_per_output_token_seconds") == list(ITL_BUCKETS)
    assert len(ITL_BUCKETS) == 19 and ITL_BUCKETS[-1] == 80.0
    assert bounds("vllm:e2e_request_latency_seconds") == list(E2E_BUCKETS)
    assert bounds("vllm:request_queue_time_seconds") == list(E2E_BUCKETS)
    assert len(E2E_BUCKETS) == 21 and E2E_BUCKETS[-1] == 7680.0
    assert bounds("vllm:iteration_tokens_total") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384
    ]  # fmt: skip
    assert bounds("vllm:request_prompt_tokens") == list(token_buckets(max_len))
    assert bounds("vllm:request_generation_tokens") == list(token_buckets(max_len))


def test_token_buckets_are_vllms_1_2_5_series() -> None:
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(131072)[-3:] == (20000, 50000, 100000)
    assert token_buckets(1) == (1,)


def test_histogram_buckets_are_le_and_cumulative() -> None:
    """A value equal to a bound lands in that bound's bucket (Prometheus ``le``); a
    weighted observation counts ``count`` times."""
    hist = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 3.0):
        hist.observe(v)
    hist.observe(0.25, 4)
    assert hist.buckets() == [("1.0", 6), ("2.0", 8), ("+Inf", 9)]
    assert hist.total == pytest.approx(0.5 + 1.0 + 1.5 + 2.0 + 3.0 + 1.0)


# -- values match the traffic ------------------------------------------------------------


async def test_counts_and_token_sums_match_n_requests_exactly(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """N requests of known sizes: success count, prompt and generation token counters,
    every request histogram's count and sum, ITL's one observation per token gap, one
    iteration observation per engine step and one lag observation per engine event."""
    sizes = [3, 5, 8, 13, 1]
    usages: list[dict[str, int]] = []
    e2e_client: list[float] = []
    async with serve() as s:

        async def one(max_tokens: int) -> None:
            start = trio.current_time()
            body = chat_body(content="the quick brown fox " * max_tokens, max_tokens=max_tokens)
            response = await s.post("/v1/chat/completions", body)
            assert response.status_code == 200
            e2e_client.append(trio.current_time() - start)
            usages.append(json.loads(await response.get_data())["usage"])

        async with trio.open_nursery() as nursery:
            for size in sizes:
                nursery.start_soon(one, size)
        _, samples = await scrape(s)
        engine = s.runtime().engine.statistics()
        snap = s.runtime().snapshot()
    n = len(sizes)
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == sum(sizes)
    assert value(samples, "vllm:request_success_total", finished_reason="length") == n
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(samples, "vllm:prompt_tokens_total") == prompt
    assert value(samples, "vllm:generation_tokens_total") == generated
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert value(samples, f"{name}_count") == n, name
        assert buckets(samples, name)["+Inf"] == n, name
    assert value(samples, "vllm:request_prompt_tokens_sum") == prompt
    assert value(samples, "vllm:request_generation_tokens_sum") == generated
    gaps = sum(size - 1 for size in sizes)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(samples, f"{name}_count") == gaps
    # the request-size histograms put each request in its 1-2-5 bucket
    gen = buckets(samples, "vllm:request_generation_tokens")
    assert (gen["1.0"], gen["2.0"], gen["5.0"], gen["10.0"], gen["20.0"]) == (1, 1, 3, 4, 5)
    # simulated times: the paced server's E2E is the engine's (no pacing lag here)
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(e2e_client), abs=1e-6
    )
    ttft_sum = value(samples, "vllm:time_to_first_token_seconds_sum")
    itl_sum = value(samples, "vllm:inter_token_latency_seconds_sum")
    assert ttft_sum + itl_sum == pytest.approx(sum(e2e_client), abs=1e-6)
    # engine-step series
    assert value(samples, "vllm:iteration_tokens_total_count") == engine.steps
    assert value(samples, "vllm:iteration_tokens_total_sum") == prompt + gaps
    assert value(samples, "inference_lab:pacing_lag_seconds_count") == snap.events
    assert value(samples, "vllm:num_preemptions_total") == engine.preemptions
    # idle again
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0


async def test_preemptions_match_the_engines_count(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Two requests that do not fit the KV cache together: the scheduler preempts, and
    the counter is the engine's own count (summed from the steps it reports)."""
    dep = make_settings(LLAMA).deployments[0]
    settings = make_settings(LLAMA, kv_cache_capacity=10 * dep.block_bytes)  # 10 blocks
    async with serve(settings) as s:
        async with trio.open_nursery() as nursery:
            for letter in "xy":  # 64 prompt tokens each, no block in common
                body = {"model": LLAMA, "prompt": letter * 256, "max_tokens": 48}
                nursery.start_soon(s.post, "/v1/completions", body)
        _, samples = await scrape(s)
        preemptions = s.runtime(LLAMA).engine.statistics().preemptions
    assert preemptions >= 1
    assert value(samples, "vllm:num_preemptions_total", LLAMA) == preemptions
    assert value(samples, "vllm:generation_tokens_total", LLAMA) == 2 * 48


async def test_gauges_show_running_and_the_admission_depth(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With one batch slot, one running stream and two queued ones: running 1, waiting 2
    (the admission depth), KV usage above 0 and the same under the deprecated name; the
    capacity gauges follow a live change."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=5)) as s:
        async with s.stream(chat_body(max_tokens=50, stream=True)) as running:
            while not running.token_times():
                assert await running.next_chunk() is not None
            async with trio.open_nursery() as nursery:
                queued = [Stream(s.app, "/v1/chat/completions", _body(4)) for _ in range(2)]
                for st in queued:
                    st.start(nursery)
                await trio.testing.wait_all_tasks_blocked()
                _, samples = await scrape(s)
                assert s.runtime().snapshot().depth == 2
                assert value(samples, "vllm:num_requests_running") == 1
                assert value(samples, "vllm:num_requests_waiting") == 2
                kv = value(samples, "vllm:kv_cache_usage_perc")
                assert 0.0 < kv <= 1.0
                assert value(samples, "vllm:gpu_cache_usage_perc") == kv
                assert value(samples, "inference_lab:max_num_seqs") == 1
                assert value(samples, "inference_lab:max_waiting") == 5
                s.runtime().set_capacity(max_waiting=7)
                _, samples = await scrape(s)
                assert value(samples, "inference_lab:max_waiting") == 7
                for st in queued:
                    await st.read_all()
            await running.read_all()


def _body(max_tokens: int) -> bytes:
    return json.dumps(chat_body(max_tokens=max_tokens, stream=True)).encode()


async def test_refusals_are_counted_by_reason(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Each 529 counts queue_saturated and each 503 engine_unavailable, per model; a
    stopped engine reads engine_alive 0; other models' series do not move."""
    async with serve(make_settings(GPT, LLAMA, max_num_seqs=1, max_waiting=1)) as s:
        async with s.stream(chat_body(max_tokens=40, stream=True)) as running:
            while not running.token_times():
                assert await running.next_chunk() is not None
            async with s.stream(chat_body(max_tokens=2, stream=True)) as queued:
                await trio.testing.wait_all_tasks_blocked()
                for _ in range(3):
                    response = await s.post("/v1/chat/completions", chat_body())
                    assert response.status_code == 529
                await queued.read_all()
            await running.read_all()
        s.runtime(LLAMA).stop()
        for _ in range(2):
            response = await s.post("/v1/chat/completions", chat_body(model=LLAMA))
            assert response.status_code == 503
        _, samples = await scrape(s)
    rejected = "inference_lab:requests_rejected_total"
    assert value(samples, rejected, GPT, reason="queue_saturated") == 3
    assert value(samples, rejected, GPT, reason="engine_unavailable") == 0
    assert value(samples, rejected, LLAMA, reason="queue_saturated") == 0
    assert value(samples, rejected, LLAMA, reason="engine_unavailable") == 2
    assert value(samples, "inference_lab:engine_alive", GPT) == 1
    assert value(samples, "inference_lab:engine_alive", LLAMA) == 0
    assert value(samples, "vllm:request_success_total", GPT, finished_reason="length") == 2


async def test_scrape_is_text_0_0_4_whatever_the_scraper_accepts(serve: ServeFactory) -> None:
    """Prometheus asks for OpenMetrics first; the answer is the text format 0.0.4 with
    vLLM's names intact (prometheus_client's OpenMetrics encoder would write ``vllm_x``
    samples under ``# TYPE vllm:x``)."""
    accept = (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
        "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    async with serve() as s:
        types, samples = await scrape(s, accept)
        response = await s.client.get("/metrics", headers={"accept": accept})
        text = (await response.get_data()).decode()
    assert "vllm:num_requests_waiting" in types
    assert value(samples, "vllm:num_requests_waiting") == 0
    assert 'vllm:num_requests_waiting{engine="0",model_name="gpt-oss-20b"} 0.0' in text
    assert "vllm_" not in text and "inference_lab_" not in text


# -- Retry-After ---------------------------------------------------------------------------


async def test_529_and_503_carry_retry_after(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A 529 carries the runtime's estimate (an integer >= 1) with x-should-retry: false;
    a 503 and an unhealthy /health carry RETRY_AFTER_UNAVAILABLE."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        async with s.stream(chat_body(max_tokens=40, stream=True)) as running:
            while not running.token_times():
                assert await running.next_chunk() is not None
            async with s.stream(chat_body(max_tokens=2, stream=True)) as queued:
                await trio.testing.wait_all_tasks_blocked()
                response = await s.post("/v1/chat/completions", chat_body())
                assert response.status_code == 529
                assert response.headers["x-should-retry"] == "false"
                retry = response.headers["retry-after"]
                assert retry.isdigit() and int(retry) >= 1
                assert int(retry) == s.runtime().retry_after()
                await queued.read_all()
            await running.read_all()
        s.runtime().stop()
        response = await s.post("/v1/chat/completions", chat_body())
        assert response.status_code == 503
        assert response.headers["retry-after"] == str(RETRY_AFTER_UNAVAILABLE)
        response = await s.client.get("/health")
        assert response.status_code == 503
        assert response.headers["retry-after"] == str(RETRY_AFTER_UNAVAILABLE)


async def test_observer_leaves_engine_events_unchanged(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The metrics observer only counts: a paced stream's token times are the same with
    and without it."""

    async def token_times(observe: bool) -> list[float]:
        async with serve() as s:
            if not observe:
                s.runtime().observer = None
            start = trio.current_time()
            async with s.stream(chat_body(max_tokens=12, stream=True)) as st:
                await st.read_all()
            return [t - start for t in st.token_times()]

    observed, unobserved = await token_times(True), await token_times(False)
    assert len(observed) == 12
    # the apps start at different virtual times: equal up to float rounding
    assert observed == pytest.approx(unobserved, abs=1e-12)


def test_every_app_has_its_own_registry_and_observers() -> None:
    """Each app's metrics live in its own registry (never prometheus_client's global
    one, which would mix the apps of one process) and observe its own runtimes."""
    a = ServeState.build(make_settings())
    b = ServeState.build(make_settings())
    assert a.metrics.registry is not b.metrics.registry
    assert a.runtimes[GPT].observer is a.metrics.models[GPT]
    assert b.runtimes[GPT].observer is b.metrics.models[GPT]


# -- fine buckets (--fine-latency-buckets) -------------------------------------------------


def histogram_quantile(q: float, cumulative: dict[str, float]) -> float:
    """Prometheus's ``histogram_quantile``: linear interpolation inside the bucket that
    holds rank q * count (the first bucket starts at 0)."""
    bounds = sorted((float(le), count) for le, count in cumulative.items() if le != "+Inf")
    total = cumulative["+Inf"]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def test_fine_buckets_keep_every_vllm_bound() -> None:
    """Rule 5: a query written for vLLM's buckets finds each of its le values."""
    from inference_lab.serve.metrics import (
        FINE_E2E_BUCKETS,
        FINE_ITL_BUCKETS,
        FINE_TTFT_BUCKETS,
    )

    for fine, vllm in (
        (FINE_TTFT_BUCKETS, TTFT_BUCKETS),
        (FINE_ITL_BUCKETS, ITL_BUCKETS),
        (FINE_E2E_BUCKETS, E2E_BUCKETS),
    ):
        assert set(vllm) <= set(fine)
        assert list(fine) == sorted(set(fine))
        assert fine[0] <= vllm[0] / 4  # finer bounds below vLLM's first one


@pytest.mark.parametrize("fine", [False, True])
async def test_fine_buckets_let_histogram_quantile_read_a_sub_millisecond_itl(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, fine: bool
) -> None:
    """One request's ITL on gpt-oss-20b / b200 is well under a millisecond: vLLM's buckets
    make histogram_quantile read the median as 5 ms (half of the first bucket, 10 ms); the
    fine buckets put it in a bucket no wider than 0.25 ms around the true value."""
    settings = attrs.evolve(make_settings(), fine_latency_buckets=fine)
    async with serve(settings) as s:
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=200))
        assert response.status_code == 200
        _, samples = await scrape(s)
        (record,) = s.state.metrics.models[GPT].recent
    finish, ttft, e2e = record
    true_itl = (e2e - ttft) / 199
    itl = histogram_quantile(0.5, buckets(samples, "vllm:inter_token_latency_seconds"))
    e2e_q = histogram_quantile(0.5, buckets(samples, "vllm:e2e_request_latency_seconds"))
    if fine:
        assert abs(itl - true_itl) <= 0.00025
        assert abs(e2e_q - e2e) <= 0.025
    else:
        assert itl == pytest.approx(0.005)
        assert e2e_q == pytest.approx(0.15)  # half of vLLM's first E2E bucket (0.3 s)


# -- the prefix cache ---------------------------------------------------------------------------


async def test_prefix_cache_counters_are_the_engines_tokens_per_replica(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """vllm:prefix_cache_queries_total / _hits_total carry the engine's own token counts,
    one series per replica (label engine); the same request twice hits on its second
    admission, and the scrape's sums equal the usage's cached tokens."""
    async with serve(make_settings()) as s:
        body = chat_body("a prompt worth caching " * 60, max_tokens=4)
        cached = []
        for _ in range(2):
            response = await s.post("/v1/chat/completions", body)
            usage = json.loads(await response.get_data())["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        prompt = usage["prompt_tokens"]
        _, samples = await scrape(s)
        stats = s.runtime().engine.statistics()
    assert value(samples, "vllm:prefix_cache_queries_total", engine="0") == 2 * prompt
    assert value(samples, "vllm:prefix_cache_hits_total", engine="0") == sum(cached) > 0
    assert stats.prefix_cache_hits == sum(cached)


async def test_cache_config_info_names_block_size_blocks_and_caching(
    serve: ServeFactory,
) -> None:
    """vllm:cache_config_info is 1 with vLLM's labels: block size, GPU blocks of each
    replica, whether prefix caching is on (str() of the value, as vLLM writes them)."""
    async with serve(make_settings(GPT, LLAMA, enable_prefix_caching=False)) as s:
        _, samples = await scrape(s)
        runtimes = {name: s.runtime(name) for name in (GPT, LLAMA)}
    for name, runtime in runtimes.items():
        dep = runtime.deployment
        labels = {
            "engine": "0",
            "block_size": str(dep.scheduler.block_size),
            "num_gpu_blocks": str(dep.total_blocks),
            "enable_prefix_caching": "False",
            "gpu_memory_utilization": str(dep.scheduler.gpu_memory_utilization),
        }
        assert value(samples, "vllm:cache_config_info", name, **labels) == 1
