"""The pacing lag told to the client: ``inference-lab-pacing-lag-ms`` on every answer of
the generation routes (the 529 too), the runtime's "how late now" figures it and the
dashboard read, on the autojump MockClock (lags forced by jumping the virtual clock past
the engine's next event: exact).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from inference_lab.runtime.lag import LAG_WINDOW, LagMeter
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.serve.app import SAMPLER_KEY
from inference_lab.serve.exchange import PACING_LAG_HEADER, Exchange
from tests.conftest import GPT, ServeFactory, chat_body, make_settings

HEADER = PACING_LAG_HEADER.decode()
LLAMA = "Llama-3-70B"  # 17.5 ms decode steps: room for a lag to show


async def _make_late(
    runtime: ModelRuntime, clock: trio.testing.MockClock, lag: float, done: trio.Event
) -> None:
    """Until ``done``: whenever the engine has an event ahead, jump the virtual clock to
    ``lag`` past it, as a stalled CPU would: each wake-up's oldest event is then handled
    exactly ``lag`` late."""
    while not done.is_set():
        t = runtime.engine.next_event_time()
        if t is not None:
            ahead = runtime.epoch + t + lag - trio.current_time()
            if ahead > 0:
                clock.jump(ahead)
        await trio.sleep(1e-6)


async def _until(check: Any) -> None:
    while not check():  # noqa: ASYNC110 - the runtime's state, no event to wait on
        await trio.sleep(1e-4)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body()),
        ("/v1/chat/completions", chat_body(stream=True)),
        ("/v1/completions", {"model": GPT, "prompt": "hello", "max_tokens": 4}),
        ("/v1/completions", {"model": GPT, "prompt": ["a", "b"], "max_tokens": 2}),
        ("/v1/responses", {"model": GPT, "input": "hello", "max_output_tokens": 4}),
        (
            "/v1/messages",
            {"model": GPT, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
async def test_every_generation_answer_of_an_idle_server_says_zero(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, path: str, body: Any
) -> None:
    async with serve() as s:
        response = await s.post(path, body)
        assert response.status_code == 200
        assert response.headers[HEADER] == "0.00"
        # a model that is not served gets no lag: there is no engine to be late
        missing = await s.post(path, {**body, "model": "nope"})
        assert missing.status_code == 404
        assert HEADER not in missing.headers
        # nor does a route that generates nothing
        assert HEADER not in (await s.client.get("/v1/models")).headers


async def test_answers_admitted_while_the_engine_is_20_ms_late_say_so_and_the_529_too(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """One seat, one waiting place; every engine event handled 20 ms late: the running
    stream was admitted into an idle engine (0.00), the one admitted behind it and the
    one refused with 529 both carry 20.00."""
    async with serve(make_settings(LLAMA, max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime(LLAMA)
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            async with s.stream(chat_body(max_tokens=200, model=LLAMA, stream=True)) as first:
                await first.next_chunk()
                nursery.start_soon(_make_late, rt, autojump_clock, 0.020, done)
                await _until(lambda: rt._lag.latest == pytest.approx(0.020))
                async with s.stream(chat_body(max_tokens=2, model=LLAMA, stream=True)) as second:
                    await _until(lambda: rt.snapshot().waiting == 1)
                    refused = await s.post("/v1/chat/completions", chat_body(model=LLAMA))
                    assert refused.status_code == 529
                    assert refused.headers[HEADER] == "20.00"
                    assert rt.pacing_lag() == pytest.approx(0.020)
                    await first.read_all()
                    await second.read_all()
                done.set()
        assert first.headers[HEADER] == "0.00"
        assert second.status == 200
        assert second.headers[HEADER] == "20.00"


async def test_the_runtime_reports_no_lag_once_idle_and_overdue_time_before_a_wake(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """An idle engine is never late, whatever its last wake-up measured; an engine whose
    next event is already 30 ms overdue (the loop blocked before it could run) is 30 ms
    late even before the engine task measures it."""
    async with serve(make_settings(LLAMA)) as s:
        rt = s.runtime(LLAMA)
        rt._lag.latest = 0.050  # a late wake-up long ago
        assert rt.pacing_lag() == 0.0
        async with s.stream(chat_body(max_tokens=50, model=LLAMA, stream=True)) as st:
            await st.next_chunk()
            t = rt.engine.next_event_time()
            assert t is not None
            rt._lag.latest = 0.0
            autojump_clock.jump(rt.epoch + t + 0.030 - trio.current_time())
            assert rt.pacing_lag() == pytest.approx(0.030)  # no checkpoint since the jump
            await st.read_all()
        assert rt.pacing_lag() == 0.0


def test_the_meter_keeps_the_recent_p99_for_one_window_only() -> None:
    meter = LagMeter(GPT)
    meter.start(0.0)
    for _ in range(100):
        meter.record(0.008)
    meter.tick(LAG_WINDOW)  # closes the first window: p99 8 ms
    assert meter.recent_p99(LAG_WINDOW + 0.5) == pytest.approx(0.008)
    assert meter.recent_p99(2 * LAG_WINDOW) == 0.0  # a quiet second since


def test_the_header_is_noted_once_per_exchange() -> None:
    exchange = Exchange({"type": "http"}, 0.0)
    exchange.note_pacing_lag(0.0123)
    exchange.note_pacing_lag(0.5)
    assert exchange.headers == [(PACING_LAG_HEADER, b"12.30")]


async def test_the_dashboard_samples_the_last_seconds_p99_and_flags_a_host_behind(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Each sample carries the pacing lag's p99 over the last second and the threshold
    the page's banner compares it with (the log warning's)."""
    async with serve(make_settings(LLAMA)) as s:
        rt = s.runtime(LLAMA)
        sampler = s.app.extensions[SAMPLER_KEY]
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_make_late, rt, autojump_clock, 0.020, done)
            await s.post("/v1/chat/completions", chat_body(max_tokens=150, model=LLAMA))
            sample = json.loads(sampler.tracks[LLAMA].ring[-1][1].split(b"data: ", 1)[1])
            done.set()
        assert sample["lag_p99_ms"] == 20.0
        assert sample["host_behind"] is True
        await trio.sleep(3 * LAG_WINDOW)
        quiet = json.loads(sampler.tracks[LLAMA].ring[-1][1].split(b"data: ", 1)[1])
        assert quiet["lag_p99_ms"] == 0.0
        assert quiet["host_behind"] is False
