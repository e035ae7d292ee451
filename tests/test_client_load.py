"""The load generator end to end against the fake server of ``tests/fake_openai_server.py``,
plus the pure parts it is built from (prompt sizing, frame classification, statistics) and
the CLI's exit codes.

The load tests reach the fake over in-memory streams (the client's injectable transport)
on pytest-trio's ``autojump_clock`` (``MockClock(autojump_threshold=0)``): the fake's token
delays are virtual, so times are exact and a deadlock fails at once at ``fail_after``. The
CLI tests run the fake on a real socket in a thread, on the real clock, and assert only
what does not depend on it.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import queue
import re
import socket
import sys
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from trio.testing import MockClock

from inference_lab.cli import build_parser, main
from inference_lab.client.http import parse_base_url
from inference_lab.client.load import (
    CONNECTION_ERROR_PAUSE,
    RETRY_AFTER_CAP,
    LoadConfig,
    LoadError,
    LoadResult,
    RequestRecord,
    run_load,
)
from inference_lab.client.report import distribution, format_summary, settled_limit, summarize
from inference_lab.client.wire import (
    StreamAccumulator,
    build_prompt,
    chat_prompt_tokens,
    completion_prompt_tokens,
    endpoint_path,
    parse_pacing_lag,
)
from tests.fake_openai_server import (
    DROP,
    FakeConfig,
    FakeServer,
    FakeStats,
    MemoryFake,
    serve_fake_openai,
)

TIMEOUT = 20
URL = "http://fake.test:8000"


async def load_against(
    fake: FakeConfig,
    *,
    url_suffix: str = "",
    on_record: Callable[[RequestRecord], None] | None = None,
    stop: trio.Event | None = None,
    limit: float = TIMEOUT,
    **options: Any,
) -> tuple[LoadResult, FakeStats]:
    """Run one load with ``options`` against the fake over memory streams (virtual time
    under ``autojump_clock``, bounded by ``limit`` virtual seconds); returns the result and the fake's
    counters."""
    async with trio.open_nursery() as nursery:
        server = MemoryFake(nursery, fake)
        config = LoadConfig(url=URL + url_suffix, model="m", **options)
        with trio.fail_after(limit):
            result = await run_load(config, on_record=on_record, stop=stop, connect=server.connect)
        nursery.cancel_scope.cancel()
    return result, server.stats


def outcome_counts(result: LoadResult) -> Counter[str]:
    return Counter(r.outcome for r in result.records)


# -- closed loop: outcomes, tokens, statistics --------------------------------------------


async def test_outcome_counts_match_what_the_server_returned(autojump_clock: MockClock) -> None:
    """Each status the fake sends (200, 529, 503, other 4xx/5xx, a dropped connection) is
    recorded once, under the right outcome and error type."""
    script = [200, 529, 503, 200, 500, 400, DROP, 529, 200, 503, 200, 200]
    result, stats = await load_against(
        FakeConfig(script=script, tokens=12), concurrency=3, requests=len(script), max_tokens=12
    )
    assert outcome_counts(result) == {
        "ok": 5,
        "overloaded": 2,
        "unavailable": 2,
        "server_error": 1,
        "client_error": 1,
        "connection_error": 1,
    }
    assert stats.statuses == Counter(script)
    by_outcome = {r.outcome: r for r in result.records}
    assert by_outcome["overloaded"].status == 529
    assert by_outcome["overloaded"].error_type == "overloaded_error"
    assert by_outcome["overloaded"].error_code == "queue_saturated"
    assert by_outcome["unavailable"].error_type == "service_unavailable_error"
    assert by_outcome["connection_error"].status is None
    summary = summarize(result)
    assert summary.outcomes == dict(outcome_counts(result))
    assert summary.attempts == summary.requests == len(script)


async def test_successful_stream_records_every_token_and_the_usage(
    autojump_clock: MockClock,
) -> None:
    """An ok stream has one arrival time per token — here exactly the fake's pacing, one
    every 10 ms from the request's start — the usage frame's counts, the finish reason, and
    E2E at the last token."""
    result, stats = await load_against(
        FakeConfig(token_delay=0.01), concurrency=2, requests=6, max_tokens=9
    )
    assert stats.bodies[0]["stream_options"] == {"include_usage": True}
    for r in result.records:
        assert r.outcome == "ok"
        assert list(r.token_times) == pytest.approx([0.01 * (i + 1) for i in range(9)])
        assert r.ttft == r.token_times[0]
        assert r.e2e == pytest.approx(0.09)
        assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (50, 9, "length")
    summary = summarize(result)
    assert summary.ttft.count == summary.e2e.count == summary.tpot.count == 6
    assert summary.itl.count == 6 * 8
    assert summary.itl.p50 == pytest.approx(0.01) and summary.itl.p99 == pytest.approx(0.01)
    assert summary.ttft.mean == pytest.approx(0.01) and summary.e2e.p50 == pytest.approx(0.09)
    assert summary.completion_tokens_mean == 9
    # 3 rounds of 2 requests, 90 ms each: 54 tokens in 0.27 s
    assert summary.output_token_throughput == pytest.approx(54 / 0.27)


async def test_error_frame_mid_stream_is_a_stream_error(autojump_clock: MockClock) -> None:
    """A 200 stream carrying the engine_failed frame is not a success: it is recorded as a
    stream error with the frame's type and code, keeping the tokens that did arrive."""
    result, stats = await load_against(
        FakeConfig(fail_after_tokens=3), concurrency=1, requests=2, max_tokens=9
    )
    for r in result.records:
        assert (r.outcome, r.status) == ("stream_error", 200)
        assert (r.error_type, r.error_code) == ("server_error", "engine_failed")
        assert len(r.token_times) == 3
    assert summarize(result).e2e.count == 0


async def test_non_streaming_requests_use_the_usage_object(autojump_clock: MockClock) -> None:
    """--no-stream: whole answers, tokens from usage, no TTFT or token times."""
    result, stats = await load_against(
        FakeConfig(), concurrency=2, requests=4, max_tokens=7, stream=False
    )
    assert stats.bodies[0]["stream"] is False
    assert "stream_options" not in stats.bodies[0]
    for r in result.records:
        assert r.outcome == "ok"
        assert (r.completion_tokens, r.ttft, len(r.token_times)) == (7, None, 0)
    summary = summarize(result)
    assert (summary.e2e.count, summary.ttft.count) == (4, 0)


async def test_completions_endpoint_and_exact_prompt_size(autojump_clock: MockClock) -> None:
    """--endpoint completions posts to /v1/completions with a prompt the server counts as
    exactly --prompt-tokens tokens; the URL's /v1 prefix is not doubled."""
    result, stats = await load_against(
        FakeConfig(tokens=4),
        url_suffix="/v1/",
        endpoint="completions",
        concurrency=1,
        requests=2,
        prompt_tokens=123,
        max_tokens=4,
    )
    assert stats.targets == ["/v1/completions"] * 2
    assert [r.prompt_tokens for r in result.records] == [123, 123]
    assert all(r.outcome == "ok" and len(r.token_times) == 4 for r in result.records)


async def test_requests_go_only_to_the_given_origin_over_kept_alive_connections(
    autojump_clock: MockClock,
) -> None:
    """Every connection is opened to the --url's origin and the Host header is its
    authority; a closed loop of N workers opens N connections and reuses them
    (keep-alive), or opens one per request if the server answers ``connection: close``."""
    result, stats = await load_against(
        FakeConfig(tokens=3), concurrency=2, requests=20, max_tokens=3
    )
    assert set(stats.origins) == {URL} and set(stats.hosts) == {"fake.test:8000"}
    # the first request takes the preflight's connection, the second opens the other one
    assert stats.connections == result.pool.opened == 2
    assert result.pool.reused == 19
    result, stats = await load_against(
        FakeConfig(tokens=3, close_connections=True), concurrency=2, requests=8, max_tokens=3
    )
    assert all(r.outcome == "ok" for r in result.records)
    assert stats.connections == result.pool.opened == 8 and result.pool.reused == 1


async def test_a_connection_the_server_closed_is_not_reused(autojump_clock: MockClock) -> None:
    """An idle connection the server has closed (a keep-alive time-out, no ``connection:
    close`` header) is found stale when it is taken from the pool and replaced before a
    request is written to it."""
    result, stats = await load_against(
        FakeConfig(tokens=3, close_idle=True), concurrency=1, requests=4, max_tokens=3
    )
    assert outcome_counts(result) == {"ok": 4}
    # the preflight's connection carried the model list and was closed after it, as each
    # request's is after its answer: every request finds its predecessor's closed
    assert (result.pool.opened, result.pool.stale_dropped, result.pool.reused) == (5, 4, 0)
    assert stats.requests == 4 and len(stats.model_lists) == 1


async def test_open_loop_sends_the_count_and_respects_the_cap(autojump_clock: MockClock) -> None:
    """--rate with --requests sends exactly N; --max-concurrency caps requests in flight."""
    result, stats = await load_against(
        FakeConfig(tokens=5, token_delay=0.002),
        rate=400.0,
        max_concurrency=3,
        requests=30,
        max_tokens=5,
        seed=1,
    )
    assert len(result.records) == stats.requests == 30
    assert outcome_counts(result) == {"ok": 30}
    assert stats.max_active == 3  # 400/s against 10 ms answers: the cap is reached


# -- bounds: duration, warm-up, drain, time-outs ----------------------------------------


async def test_duration_and_warmup_bound_the_run_and_the_statistics(
    autojump_clock: MockClock,
) -> None:
    """No request starts after --duration; latency covers requests started after the
    warm-up; throughput counts ok completions inside [warmup, duration]."""
    result, stats = await load_against(
        FakeConfig(tokens=5, token_delay=0.004),
        concurrency=2,
        duration=0.6,
        warmup=0.2,
        max_tokens=5,
    )
    records = result.records
    # 2 workers, 20 ms requests back to back: starts at 0, 0.02, ..., 0.58
    assert len(records) == 2 * 30 and max(r.start for r in records) < 0.6
    assert result.dispatch_end == pytest.approx(0.6) and result.end == pytest.approx(0.6)
    summary = summarize(result)
    ok_after = [r for r in records if r.outcome == "ok" and r.start >= 0.2 - 1e-9]
    assert summary.e2e.count == len(ok_after)
    assert summary.window == pytest.approx(0.4)
    inside = [r for r in records if r.outcome == "ok" and 0.2 <= r.end <= 0.6]
    assert summary.request_throughput == pytest.approx(len(inside) / 0.4)
    assert summary.output_token_throughput == pytest.approx(5 * len(inside) / 0.4)


async def test_drain_timeout_cancels_stragglers(autojump_clock: MockClock) -> None:
    """With --duration, requests still running at duration + drain_timeout are cancelled
    and recorded as such, and the run ends then."""
    result, stats = await load_against(
        FakeConfig(tokens=50, token_delay=0.2),
        concurrency=2,
        duration=0.1,
        drain_timeout=0.2,
        max_tokens=50,
    )
    assert result.end == pytest.approx(0.3)
    assert outcome_counts(result) == {"cancelled": 2}
    assert [len(r.token_times) for r in result.records] == [1, 1]  # the token at 0.2 s


async def test_request_timeout_records_a_timeout(autojump_clock: MockClock) -> None:
    """A request slower than --request-timeout is cut at exactly that time and recorded as
    a timeout."""
    result, stats = await load_against(
        FakeConfig(tokens=50, token_delay=0.2),
        concurrency=2,
        requests=2,
        max_tokens=50,
        request_timeout=0.3,
    )
    assert outcome_counts(result) == {"timeout": 2}
    assert [r.e2e for r in result.records] == pytest.approx([0.3, 0.3])


async def test_connection_errors_do_not_spin(autojump_clock: MockClock) -> None:
    """A server that drops every connection gets one attempt per slot per
    CONNECTION_ERROR_PAUSE, and each record ends when the failure happened, not after the
    pause."""
    result, stats = await load_against(
        FakeConfig(default_status=DROP), concurrency=2, duration=0.35
    )
    assert outcome_counts(result) == {"connection_error": len(result.records)}
    per_slot = math.ceil(0.35 / CONNECTION_ERROR_PAUSE)  # at 0, 0.1, 0.2, 0.3
    assert len(result.records) == 2 * per_slot == stats.requests
    assert all(r.e2e == 0 for r in result.records)


async def test_stop_event_ends_the_run_with_a_partial_result(autojump_clock: MockClock) -> None:
    """Setting ``stop`` (the CLI's Ctrl-C) cancels everything in flight at once."""
    stop = trio.Event()
    seen: list[RequestRecord] = []

    def on_record(record: RequestRecord) -> None:
        seen.append(record)
        if len(seen) == 3:
            stop.set()

    result, stats = await load_against(
        FakeConfig(tokens=3, token_delay=0.01),
        concurrency=2,
        duration=60.0,
        on_record=on_record,
        stop=stop,
    )
    assert result.interrupted
    # two rounds of 30 ms requests: the third record comes at 0.06 s, and nothing after it
    assert result.end == pytest.approx(0.06)
    assert outcome_counts(result) == {"ok": 4, "cancelled": 2}


async def test_unreachable_server_is_a_load_error() -> None:
    """No server on the port: one LoadError before the run, not a run of failures (a real
    socket: this is the TCP transport's refusal)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with trio.fail_after(TIMEOUT), pytest.raises(LoadError, match="cannot connect"):
        await run_load(
            LoadConfig(url=f"http://127.0.0.1:{port}", model="m", concurrency=1, requests=1)
        )


# -- adaptive (AIMD) ---------------------------------------------------------------------


async def test_adaptive_limit_saw_tooths_around_the_servers_capacity(
    autojump_clock: MockClock,
) -> None:
    """Against a fake that refuses beyond K concurrent requests, the limit climbs until
    529s come back, is halved, climbs again: every cut starts above K, the limit never
    runs far past K+1, and the settled limit lies between K/2 and K+1."""
    k = 4
    result, stats = await load_against(
        FakeConfig(capacity=k, tokens=8, token_delay=0.002),
        adaptive="aimd",
        duration=2.0,
        max_tokens=8,
        sample_interval=0.1,
    )
    assert stats.max_active <= k
    changes = result.limit_changes
    assert changes[0] == (0.0, 1)
    cuts = [
        (old, new) for (_, old), (_, new) in zip(changes, changes[1:], strict=False) if new < old
    ]
    assert len(cuts) >= 3, changes
    for old, new in cuts:
        assert old >= k + 1
        assert new == old // 2
    assert result.controller is not None
    assert result.controller.max_limit_seen <= k + 3
    summary = summarize(result)
    assert summary.adaptive is not None
    assert summary.adaptive.settled_limit is not None
    assert k // 2 <= summary.adaptive.settled_limit <= k + 1
    assert summary.adaptive.overloaded == outcome_counts(result)["overloaded"] > 0
    assert summary.adaptive.retries > 0
    assert any(s.overloaded for s in result.samples)
    assert all(s.limit is not None and 1 <= s.limit <= k + 3 for s in result.samples)


async def test_adaptive_retries_every_refused_request(autojump_clock: MockClock) -> None:
    """With --requests N, each of the N requests ends ok: a 529'd one is sent again (same
    request number, next attempt) until it gets through."""
    result, stats = await load_against(
        FakeConfig(capacity=3, tokens=4, token_delay=0.002),
        adaptive="aimd",
        concurrency=6,
        window=4,
        requests=40,
        max_tokens=4,
    )
    ok = [r for r in result.records if r.outcome == "ok"]
    assert sorted(r.request for r in ok) == list(range(40))
    refused = [r for r in result.records if r.outcome == "overloaded"]
    assert refused, "a starting limit of 6 against capacity 3 must be refused"
    attempts = {(r.request, r.attempt) for r in result.records}
    for r in refused:
        assert (r.request, r.attempt + 1) in attempts
    summary = summarize(result)
    assert summary.adaptive is not None and summary.adaptive.given_up == 0
    assert stats.requests == len(result.records)


async def test_adaptive_ignores_503(autojump_clock: MockClock) -> None:
    """503s (engine down) are not overload: the limit neither falls nor rises and nothing
    is retried."""
    result, stats = await load_against(
        FakeConfig(default_status=503), adaptive="aimd", concurrency=4, requests=30
    )
    assert outcome_counts(result) == {"unavailable": 30}
    assert stats.requests == 30
    assert result.limit_changes == ((0.0, 4),)
    assert result.controller is not None and result.controller.overloads == 0


# -- the model check, failed runs, Retry-After --------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "target"), [("", "/v1/models"), ("/v1", "/v1/models"), ("/api", "/api/v1/models")]
)
async def test_an_unknown_model_is_one_error_before_any_request(
    suffix: str, target: str, autojump_clock: MockClock
) -> None:
    """The model list is read before the clock starts (under the URL's prefix, ``/v1`` not
    doubled); a model it does not list is a LoadError naming the model and the ones served,
    and no completion request is sent."""
    async with trio.open_nursery() as nursery:
        fake = MemoryFake(nursery, FakeConfig(models=("gpt-oss-20b", "Llama-3-70B")))
        config = LoadConfig(url=URL + suffix, model="WRONG", concurrency=8, duration=2.0)
        with trio.fail_after(TIMEOUT), pytest.raises(LoadError) as info:
            await run_load(config, connect=fake.connect)
        nursery.cancel_scope.cancel()
    assert str(info.value) == (
        f"model 'WRONG' is not served by {URL}{suffix} (it serves: gpt-oss-20b, Llama-3-70B)"
    )
    assert fake.stats.model_lists == [target] and fake.stats.requests == 0


async def test_a_served_model_passes_the_check_on_the_first_connection(
    autojump_clock: MockClock,
) -> None:
    """With the model listed the run goes ahead; the list is read once, on the connection
    the first request then reuses."""
    result, stats = await load_against(FakeConfig(tokens=2), concurrency=1, requests=3)
    assert outcome_counts(result) == {"ok": 3}
    assert stats.model_lists == ["/v1/models"] and stats.connections == 1


async def test_an_unreadable_model_list_is_an_error_unless_the_check_is_off(
    autojump_clock: MockClock,
) -> None:
    """A model list answered with an error is a LoadError quoting the status and the error
    (and naming ``--no-model-check``); with ``check_model=False`` nothing is asked."""
    async with trio.open_nursery() as nursery:
        fake = MemoryFake(nursery, FakeConfig(models_status=401))
        config = LoadConfig(url=URL, model="m", concurrency=1, requests=1)
        with trio.fail_after(TIMEOUT), pytest.raises(LoadError) as info:
            await run_load(config, connect=fake.connect)
        nursery.cancel_scope.cancel()
    assert str(info.value) == (
        f"GET {URL}/v1/models answered 401 (fake_401: fake 401) "
        "(--no-model-check sends the requests anyway)"
    )
    result, stats = await load_against(
        FakeConfig(models_status=404, tokens=2), concurrency=1, requests=2, check_model=False
    )
    assert outcome_counts(result) == {"ok": 2} and stats.model_lists == []


async def test_the_first_error_is_the_first_failed_attempt(autojump_clock: MockClock) -> None:
    """The summary's first error is the first attempt, in start order, that failed, with
    its status, code and message; in an adaptive run a 529 is the controller's signal and
    not an error; a run without failures has none."""
    result, _ = await load_against(
        FakeConfig(script=[200, 529, 500], tokens=2), concurrency=1, requests=4
    )
    summary = summarize(result)
    assert summary.first_error is not None and not summary.all_failed
    assert (summary.first_error.index, summary.first_error.status) == (1, 529)
    assert summary.first_error.error_code == "queue_saturated"
    assert summary.first_error.message is not None
    assert summary.first_error.message.startswith("Server is at capacity")
    result, _ = await load_against(
        FakeConfig(script=[529, 200, 500], tokens=2), adaptive="aimd", requests=3
    )
    first = summarize(result).first_error
    assert first is not None and first.status == 500
    result, _ = await load_against(FakeConfig(tokens=2), concurrency=1, requests=2)
    assert summarize(result).first_error is None


async def test_a_run_in_which_every_request_failed_is_marked(autojump_clock: MockClock) -> None:
    """``all_failed``: at least one attempt and no success."""
    result, _ = await load_against(FakeConfig(default_status=404), concurrency=4, requests=20)
    summary = summarize(result)
    assert summary.all_failed and summary.attempts == len(result.records) > 0
    assert summary.first_error is not None and summary.first_error.error_code == "fake_404"


async def test_retry_after_holds_a_closed_loop_worker(autojump_clock: MockClock) -> None:
    """With ``retry_after`` a worker answered 529 with ``Retry-After: 2`` sends its next
    request 2 s later; without it, at once. The record keeps the header and the wait, and
    the summary counts the waits and their total."""
    fake = FakeConfig(script=[529, 529], tokens=2, retry_after="2")
    result, _ = await load_against(fake, concurrency=1, requests=3, retry_after=True)
    starts = [r.start for r in result.records]
    assert [r.outcome for r in result.records] == ["overloaded", "overloaded", "ok"]
    assert starts[1] == pytest.approx(2.0) and starts[2] == pytest.approx(4.0)
    assert [r.retry_after for r in result.records] == [2.0, 2.0, None]
    assert [r.retry_wait for r in result.records] == [pytest.approx(2.0)] * 2 + [0.0]
    assert result.records[0].end == pytest.approx(0.0)  # the record ends with its answer
    summary = summarize(result)
    assert summary.retry_after is not None
    assert (summary.retry_after.waits, summary.retry_after.total) == (2, pytest.approx(4.0))
    result, _ = await load_against(fake, concurrency=1, requests=3)
    assert result.records[2].start == pytest.approx(0.0)
    assert summarize(result).retry_after is None


async def test_retry_after_is_capped_and_ends_with_dispatching(autojump_clock: MockClock) -> None:
    """A wait is at most RETRY_AFTER_CAP; a wait still running when the run stops
    starting requests ends then (nothing would use the slot); a refusal without the
    header frees its slot at once and is counted."""
    fake = FakeConfig(script=[529], tokens=2, retry_after="600")
    result, _ = await load_against(
        fake, concurrency=1, requests=2, retry_after=True, limit=2 * RETRY_AFTER_CAP
    )
    assert result.records[1].start == pytest.approx(RETRY_AFTER_CAP)
    summary = summarize(result)
    assert summary.retry_after is not None and summary.retry_after.capped == 1
    result, _ = await load_against(
        FakeConfig(default_status=529, retry_after="30"),
        concurrency=2,
        duration=1.0,
        retry_after=True,
    )
    assert len(result.records) == 2 and result.end == pytest.approx(1.0)
    assert [r.retry_wait for r in result.records] == [pytest.approx(1.0)] * 2
    result, _ = await load_against(
        FakeConfig(script=[529, 503], tokens=2), concurrency=1, requests=3, retry_after=True
    )
    summary = summarize(result)
    assert summary.retry_after is not None
    assert (summary.retry_after.waits, summary.retry_after.without_header) == (0, 2)


async def test_retry_after_delays_the_adaptive_retry(autojump_clock: MockClock) -> None:
    """Adaptive: the retry of a request answered 529 with ``Retry-After: 1`` goes out 1 s
    later, and the controller saw the 529 at once (the limit was cut at the answer)."""
    fake = FakeConfig(script=[200, 529], tokens=2, token_delay=0.01, retry_after="1")
    result, _ = await load_against(
        fake, adaptive="aimd", concurrency=2, window=1, requests=2, retry_after=True
    )
    retried = [r for r in result.records if r.request == 1]
    assert [r.attempt for r in retried] == [0, 1]
    assert retried[1].start - retried[0].end == pytest.approx(1.0)
    cut = [(t, limit) for t, limit in result.limit_changes if limit == 1]
    assert cut and cut[0][0] == pytest.approx(retried[0].end)


def test_retry_after_is_refused_for_an_open_loop() -> None:
    """Open-loop arrivals do not wait for answers: ``--retry-after`` with ``--rate`` is a
    usage error."""
    with pytest.raises(ValueError, match="--retry-after needs --concurrency or --adaptive"):
        LoadConfig(url=URL, model="m", rate=5.0, requests=5, retry_after=True)


# -- pure parts --------------------------------------------------------------------------


def test_prompt_is_sized_by_the_servers_counting_rule() -> None:
    """Completions prompts hit every size exactly; chat prompts hit the requested size or,
    where the 5 % template overhead skips it, a neighbour (1 away)."""
    reachable = {chat_prompt_tokens(b) for b in range(0, 5000)}
    for tokens in range(1, 1000):
        assert completion_prompt_tokens(len(build_prompt(tokens, "completions"))) == tokens
        chat = chat_prompt_tokens(len(build_prompt(tokens, "chat")))
        if tokens in reachable:
            assert chat == tokens, tokens
        else:
            assert abs(chat - tokens) == 1, tokens


def test_endpoint_paths() -> None:
    """Base URL paths with and without the OpenAI-style /v1 suffix."""
    assert endpoint_path("", "chat") == "/v1/chat/completions"
    assert endpoint_path("/v1", "completions") == "/v1/completions"
    assert endpoint_path("/proxy", "chat") == "/proxy/v1/chat/completions"


@pytest.mark.parametrize(
    "url",
    ["https://x:1", "ftp://x", "http://", "http://x:99999", "http://x/?a=1", "x:80"],
)
def test_bad_urls_are_refused(url: str) -> None:
    """Only plain http://host[:port][/path] is accepted."""
    with pytest.raises(ValueError, match="--url"):
        parse_base_url(url)


def _compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@given(st.text(max_size=30), st.sampled_from(["chat", "completions"]), st.booleans())
def test_fast_path_agrees_with_full_json_decoding(text: str, kind: str, openai_nulls: bool) -> None:
    """Whatever the generated text (quotes, backslashes, marker look-alikes, non-ASCII), the
    substring fast path counts exactly what decoding the frame would."""
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": text}} if kind == "chat" else {"text": text, "index": 0}
    )
    if openai_nulls:
        choice["finish_reason"] = None
    frame: dict[str, Any] = {"id": "x", "choices": [choice]}
    if openai_nulls:
        frame["usage"] = None
    for data in (_compact(frame), json.dumps(frame)):
        fast = StreamAccumulator()
        slow = StreamAccumulator()
        assert fast.feed(data) == slow._slow(data) == (1 if text else 0)
        assert fast.finish_reason is None and fast.error_type is None


def test_special_frames_are_decoded() -> None:
    """Usage, finish reason (also together with the last token), errors and [DONE] are
    never mistaken for plain token frames."""
    acc = StreamAccumulator()
    role = _compact({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert acc.feed(role) == 0
    last = _compact({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]})
    assert acc.feed(last) == 1 and acc.finish_reason == "stop"
    usage = _compact({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert acc.feed(usage) == 0 and (acc.prompt_tokens, acc.completion_tokens) == (5, 2)
    assert acc.feed("[DONE]") == 0 and acc.done
    err = StreamAccumulator()
    assert err.feed(_compact({"error": {"type": "server_error", "code": "engine_failed"}})) == 0
    assert (err.error_type, err.error_code) == ("server_error", "engine_failed")


def test_distribution_percentiles() -> None:
    """p50/p90/p99 use linear interpolation; an empty sample gives nulls, not NaN."""
    d = distribution(float(x) for x in range(1, 101))
    assert (d.count, d.mean, d.p50, d.max) == (100, 50.5, 50.5, 100.0)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    empty = distribution([])
    assert (empty.count, empty.mean, empty.p50) == (0, None, None)


def test_settled_limit_is_the_time_weighted_median_of_the_final_third() -> None:
    """Only [2/3·end, end] counts, weighted by how long each limit was in force."""
    assert settled_limit([(0.0, 1), (10.0, 10), (20.0, 4)], 30.0) == 4
    assert settled_limit([(0.0, 8), (18.0, 6), (24.0, 10)], 30.0) == 10
    assert settled_limit([(0.0, 8), (18.0, 6), (26.0, 10)], 30.0) == 6
    assert settled_limit([], 30.0) is None


def _record(index: int, start: float, end: float, outcome: Any, tokens: int = 0) -> RequestRecord:
    times = array("d", [0.01 * (i + 1) for i in range(tokens)])
    return RequestRecord(
        index=index,
        request=index,
        attempt=0,
        start=start,
        end=end,
        status=200 if outcome == "ok" else 529,
        outcome=outcome,
        token_times=times,
        ttft=times[0] if tokens else None,
        completion_tokens=tokens if outcome == "ok" else None,
        prompt_tokens=10 if outcome == "ok" else None,
    )


def test_throughput_counts_completions_inside_the_window() -> None:
    """Rule 2 of report.py on a synthetic run: 10 s with a 2 s warm-up."""
    from inference_lab.client.http import PoolStatistics

    records = (
        _record(0, 0.0, 1.0, "ok", 4),  # finished in the warm-up: neither
        _record(1, 1.0, 3.0, "ok", 4),  # started in warm-up: throughput only
        _record(2, 3.0, 5.0, "ok", 4),  # both
        _record(3, 4.0, 4.1, "overloaded"),  # not ok: neither
        _record(4, 9.0, 11.0, "ok", 4),  # finished in the drain: latency only
    )
    result = LoadResult(
        config=LoadConfig(url="http://h", model="m", concurrency=1, duration=10, warmup=2),
        started_at=0.0,
        dispatch_end=10.0,
        end=11.0,
        records=records,
        samples=(),
        limit_changes=(),
        controller=None,
        pool=PoolStatistics(opened=1, reused=0, idle=0, stale_dropped=0),
        interrupted=False,
    )
    s = summarize(result)
    assert s.window == 8.0
    assert s.request_throughput == 2 / 8
    assert s.output_token_throughput == 8 / 8
    assert s.total_token_throughput == 28 / 8
    assert s.e2e.count == 2 and s.e2e.mean == 2.0
    assert s.measured_outcomes == {"ok": 2, "overloaded": 1}
    assert s.itl.count == 6


# -- CLI ---------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_server_in_thread(config: FakeConfig) -> Iterator[FakeServer]:
    """The fake in its own thread and trio run, for tests of the synchronous CLI."""
    ready: queue.Queue[tuple[FakeServer, trio.lowlevel.TrioToken, trio.CancelScope]] = queue.Queue()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_fake_openai, config)
            ready.put((server, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    server, token, scope = ready.get(timeout=TIMEOUT)
    try:
        yield server
    finally:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(TIMEOUT)


def test_cli_writes_summary_rows_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`load --adaptive aimd -o --csv --plot` exits 0 and writes a JSON summary with the
    time series, one CSV row per attempt, and a PNG."""
    out, rows, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    with fake_server_in_thread(FakeConfig(capacity=3, tokens=5, token_delay=0.002)) as server:
        code = main(
            [
                "load", "--url", server.url, "--model", "m", "--adaptive", "aimd", "--requests", "60",
                "--max-tokens", "5", "--window", "4", "--sample-interval", "0.05",
                "-o", str(out), "--csv", str(rows), "--plot", str(png), "-q",
            ]
        )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "settled limit" in printed and "TTFT" in printed
    doc = json.loads(out.read_text())
    assert doc["summary"]["outcomes"]["ok"] == 60
    assert doc["summary"]["adaptive"]["settled_limit"] >= 1
    assert doc["config"]["adaptive"] == "aimd"
    assert doc["limit_changes"][0] == [0.0, 1]
    assert isinstance(doc["timeseries"], list)
    with rows.open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == doc["summary"]["attempts"] == server.stats.requests
    ok_row = next(r for r in table if r["outcome"] == "ok")
    assert len(ok_row["token_times"].split(";")) == 5
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "2", "--rate", "3", "--requests", "1"],  # both shapes
        ["--concurrency", "2"],  # no bound
        ["--concurrency", "2", "--duration", "1", "--requests", "1"],  # both bounds
        ["--concurrency", "0", "--requests", "1"],
        ["--rate", "-1", "--requests", "1"],
        ["--concurrency", "1", "--requests", "1", "--endpoint", "embeddings"],
    ],
)
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Malformed options are argparse errors: one error line, exit 2."""
    assert main(["load", "--url", "http://127.0.0.1:1", "--model", "m", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("inference-lab load: error: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "1"], "exactly one of --concurrency and --rate"),
        (["--adaptive", "aimd", "--rate", "2", "--requests", "1"], "--rate is not allowed"),
        (["--concurrency", "1", "--requests", "1", "--window", "4"], "--window needs --adaptive"),
        (["--concurrency", "1", "--requests", "1", "--max-concurrency", "4"], "--max-concurrency"),
        (["--concurrency", "1", "--duration", "1", "--warmup", "2"], "--warmup"),
        (["--adaptive", "aimd", "--requests", "1", "--backoff", "1.5"], "--backoff"),
        (["--rate", "5", "--requests", "1", "--retry-after"], "--retry-after needs"),
    ],
)
def test_invalid_combinations_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Combinations argparse cannot express are refused the same way: one line, exit 2."""
    code = main(["load", "--url", "http://127.0.0.1:1", "--model", "m", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0]


def test_bad_url_and_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --url exits 2; a well-formed one nobody listens on exits 1; one line each."""
    argv = ["load", "--url", "https://x", "--model", "m", "--concurrency", "1"]
    assert main([*argv, "--requests", "1"]) == 2
    assert "--url must start with http://" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["load", "--url", f"http://127.0.0.1:{port}", "--model", "m", "--concurrency", "1"]
    assert main([*argv, "--requests", "1", "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot connect" in err[0]


def test_cli_an_unknown_model_is_one_line_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    """``load --model WRONG`` sends nothing: one line naming the models served, exit 1."""
    with fake_server_in_thread(FakeConfig(models=("gpt-oss-20b", "m2"))) as server:
        argv = ["load", "--url", server.url, "--model", "WRONG", "--concurrency", "8"]
        assert main([*argv, "--duration", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"inference-lab load: error: model 'WRONG' is not served by {server.url} "
        "(it serves: gpt-oss-20b, m2)"
    ]
    assert captured.out == "" and server.stats.requests == 0


def test_cli_a_run_in_which_every_request_failed_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every attempt failed: the summary (with the first error) is printed and written, and
    the command exits 1 with one line quoting the first failure."""
    out = tmp_path / "r.json"
    with fake_server_in_thread(FakeConfig(default_status=404)) as server:
        argv = ["load", "--url", server.url, "--model", "m", "--concurrency", "2", "-q"]
        assert main([*argv, "--requests", "6", "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "inference-lab load: error: all 6 attempts failed (first: HTTP 404 fake_404: fake 404)"
    ]
    assert "first error (attempt 0, at 0.00 s): HTTP 404 fake_404: fake 404" in captured.out
    summary = json.loads(out.read_text())["summary"]
    assert summary["all_failed"] is True
    assert summary["first_error"]["status"] == 404
    assert summary["first_error"]["error_code"] == "fake_404"


def test_cli_retry_after_is_reported_in_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """``--retry-after``: the summary says how many waits there were and their total; the
    run still exits 0 (some requests succeeded)."""
    fake = FakeConfig(script=[529, 529], tokens=2, retry_after="0.05")
    with fake_server_in_thread(fake) as server:
        argv = ["load", "--url", server.url, "--model", "m", "--concurrency", "1", "-q"]
        assert main([*argv, "--requests", "3", "--retry-after"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("retry-after: "))
    assert re.fullmatch(
        r"retry-after: 2 waits for Retry-After, [\d.]+ s in all \(longest [\d.]+ s\)", line
    )


async def test_the_servers_pacing_lag_is_recorded_and_reported(autojump_clock: MockClock) -> None:
    """Every answer's ``inference-lab-pacing-lag-ms`` (the 529's too) lands in its record;
    the report gives their mean and max, and says the host was behind when the mean is a
    large share of the TTFT (the fake's first token comes 10 ms after the request)."""
    lags = ("0.50", "2.00", "8.00", "9.50")
    fake = FakeConfig(script=[200, 529, 200, 200], tokens=2, token_delay=0.01, pacing_lags=lags)
    result, _ = await load_against(fake, concurrency=1, requests=4, max_tokens=2)
    assert [r.pacing_lag for r in result.records] == [0.0005, 0.002, 0.008, 0.0095]
    assert [r.status for r in result.records] == [200, 529, 200, 200]
    summary = summarize(result)
    assert summary.pacing_lag is not None
    assert summary.pacing_lag.count == 4
    assert summary.pacing_lag.mean == pytest.approx(0.0050)
    assert summary.pacing_lag.max == pytest.approx(0.0095)
    lines = format_summary(result, summary).splitlines()
    at = lines.index(
        "server pacing lag at admission (inference-lab-pacing-lag-ms, 4 answers): "
        "mean 5.00 ms · max 9.50 ms"
    )
    assert lines[at + 1].startswith("  the server's host was behind: its engine ran 5.0 ms late")
    assert "50% of the mean TTFT" in lines[at + 1]


async def test_a_small_pacing_lag_is_reported_without_blame(autojump_clock: MockClock) -> None:
    fake = FakeConfig(tokens=2, token_delay=0.01, pacing_lags=("0.00", "0.20"))
    result, _ = await load_against(fake, concurrency=1, requests=4, max_tokens=2)
    text = format_summary(result, summarize(result))
    assert "(inference-lab-pacing-lag-ms, 4 answers): mean 0.10 ms · max 0.20 ms" in text
    assert "host was behind" not in text


async def test_a_server_without_the_header_gets_no_lag_line(autojump_clock: MockClock) -> None:
    result, _ = await load_against(FakeConfig(tokens=2), concurrency=1, requests=2, max_tokens=2)
    summary = summarize(result)
    assert summary.pacing_lag is None
    assert "pacing lag" not in format_summary(result, summary)


def test_a_malformed_pacing_lag_is_ignored() -> None:
    assert parse_pacing_lag(b"1.5") == 0.0015
    for bad in (b"", b"x", b"-1", b"nan", b"inf"):
        assert parse_pacing_lag(bad) is None


def test_load_help_describes_every_option() -> None:
    """Every ``load`` option has a description in ``--help`` (``--prompt-tokens``,
    ``--max-tokens`` and ``--endpoint`` among them)."""
    _, parser = build_parser("load")
    assert parser is not None
    bare = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert bare == []
    text = " ".join(parser.format_help().split())
    assert "--prompt-tokens N prompt size in tokens" in text
    assert "--max-tokens N max_tokens of every request" in text
    assert "POST /v1/completions" in text


UNREACHABLE = ["load", "--url", "http://127.0.0.1:1", "--model", "m", "--concurrency", "1"]


def test_output_directory_must_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A result file in a missing directory is refused before the run (no connection is
    tried: the server here does not exist), not after it."""
    assert main([*UNREACHABLE, "--requests", "1", "-o", str(tmp_path / "no" / "r.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "-o" in err[0] and "does not exist" in err[0]


def test_plot_without_matplotlib_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """matplotlib is the ``plot`` extra: --plot without it is refused before the run with
    the install hint, exit 1; without --plot the package never needs it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert main([*UNREACHABLE, "--requests", "1", "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "inference-lab load: error: --plot needs matplotlib: pip install 'inference-lab[plot]'"
    ]
