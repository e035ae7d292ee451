"""Pacing to wall-clock, on the autojump MockClock: virtual times are exact.

Tokens of a step leave at ``epoch + step end``: a lone request's TTFT is its prefill step's
roofline cost, its E2E the sum of its steps, whatever the server did before; overlapping
requests share steps priced for their batch; a stalled reader delays nobody else.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from inference_lab.core.config import Deployment
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.core.roofline import Roofline
from inference_lab.runtime import model_runtime as runtime_module
from inference_lab.runtime.calibration import MAX_EARLY, PacingCalibration
from inference_lab.runtime.lag import LAG_WARN_EVERY, LAG_WARN_P99, LAG_WINDOW
from inference_lab.runtime.model_runtime import ModelRuntime
from tests.conftest import GPT, ServeFactory, Stream, chat_body, make_settings

P = 5  # "user: hello world" counts 5 prompt tokens


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-12, abs=1e-12)


def step_time(dep: Deployment, n: list[int], c: list[int]) -> float:
    return Roofline(dep).step_time(np.array(n, dtype=np.int64), np.array(c, dtype=np.int64))


def lone_request_times(dep: Deployment, prompt: int, max_tokens: int) -> list[float]:
    """Token times (from arrival) of a request alone on an idle engine, from the roofline:
    the prefill step over the prompt, then one decode step per further token."""
    t = step_time(dep, [prompt], [0])
    times = [t]
    for k in range(1, max_tokens):
        t += step_time(dep, [1], [prompt + k - 1])
        times.append(t)
    return times


def engine_oracle(dep: Deployment, arrivals: list[tuple[float, int, int]]) -> list[list[float]]:
    """Token times per request from a bare Engine: each arrival (time, prompt, max_tokens)
    is submitted after every event at or before its time, as the runtime does."""
    engine = Engine(dep)
    times: dict[int, list[float]] = {}
    ids = []

    def run_until(limit: float | None) -> None:
        while (t := engine.next_event_time()) is not None and (limit is None or t <= limit):
            events = engine.step()
            for rid, count in events.tokens:
                times.setdefault(rid, []).extend([events.time] * count)

    for at, prompt, max_tokens in arrivals:
        run_until(at)
        if engine.is_idle():
            engine.advance_to(at)
        ids.append(engine.submit(RequestSpec(prompt, max_tokens, arrival_time=at)))
    run_until(None)
    return [times[rid] for rid in ids]


async def timed_stream(stream: Stream, t0: float) -> list[float]:
    await stream.read_all()
    return [t - t0 for t in stream.token_times()]


async def test_lone_request_ttft_is_its_prefill_cost_and_e2e_the_sum_of_steps(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    settings = make_settings()
    dep = settings.deployments[0]
    expected = lone_request_times(dep, P, 6)
    async with serve(settings) as s:
        t0 = trio.current_time()
        async with s.stream(chat_body(max_tokens=6, stream=True)) as stream:
            first = await stream.next_chunk()
            assert first is not None and b'"role":"assistant"' in first
            assert trio.current_time() == t0  # the role frame leaves at admission
            got = await timed_stream(stream, t0)
        assert s.runtime().snapshot().lag_max == 0.0
    assert len(got) == 6
    assert got[0] == approx(step_time(dep, [P], [0]))
    assert got == [approx(t) for t in expected]


async def test_a_frontend_latency_delays_every_token_by_it_and_counts_in_the_metrics(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``frontend_latency`` L: the engine takes a request L after its arrival, so each
    token of a lone request leaves L later than without it, and the server's own TTFT
    (its Prometheus histogram) counts from the arrival, L included."""
    latency = 0.004
    settings = make_settings(frontend_latency=latency)
    expected = lone_request_times(settings.deployments[0], P, 4)
    async with serve(settings) as s:
        t0 = trio.current_time()
        async with s.stream(chat_body(max_tokens=4, stream=True)) as stream:
            got = await timed_stream(stream, t0)
        metrics = (await (await s.client.get("/metrics")).get_data()).decode()
    assert got == [approx(t + latency) for t in expected]
    total = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_sum")
    )
    assert total == approx(expected[0] + latency)


async def test_request_into_a_server_idle_for_an_hour_is_paced_the_same(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """No cold-start burst: the idle clock is moved up to the arrival."""
    settings = make_settings()
    expected = lone_request_times(settings.deployments[0], P, 4)
    results = []
    async with serve(settings) as s:
        for _ in range(2):
            await trio.sleep(3600)
            t0 = trio.current_time()
            async with s.stream(chat_body(max_tokens=4, stream=True)) as stream:
                results.append(await timed_stream(stream, t0))
    for got in results:
        assert got == [approx(t) for t in expected]


async def test_non_streaming_response_leaves_with_the_last_token(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    settings = make_settings()
    expected = lone_request_times(settings.deployments[0], P, 5)
    async with serve(settings) as s:
        await trio.sleep(10)
        t0 = trio.current_time()
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=5))
        assert response.status_code == 200
        assert trio.current_time() - t0 == approx(expected[-1])


async def test_overlapping_requests_share_steps_priced_for_their_batch(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """B arrives just after A's second token; from the next step boundary A and B run in
    one batch: B's prefill with A's decode, then decodes priced for batch 2."""
    settings = make_settings()
    dep = settings.deployments[0]
    async with serve(settings) as s:
        t0 = trio.current_time()
        async with s.stream(chat_body(max_tokens=6, stream=True)) as a:
            while len(a.token_times()) < 2:
                await a.next_chunk()
            t_b = trio.current_time()
            async with s.stream(chat_body(max_tokens=3, stream=True)) as b:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(a.read_all)
                    nursery.start_soon(b.read_all)
    got_a = [t - t0 for t in a.token_times()]
    got_b = [t - t0 for t in b.token_times()]
    tb = t_b - t0
    # A alone: prefill, decode (token 2, at tb), decode (token 3, already chosen at tb).
    t1 = step_time(dep, [P], [0])
    t2 = t1 + step_time(dep, [1], [P])
    t3 = t2 + step_time(dep, [1], [P + 1])
    # Boundary t3: A decodes token 4 while B prefills.
    t4 = t3 + step_time(dep, [1, P], [P + 2, 0])
    # Then both decode: batch 2.
    t5 = t4 + step_time(dep, [1, 1], [P + 3, P])
    t6 = t5 + step_time(dep, [1, 1], [P + 4, P + 1])
    assert tb == approx(t2)
    assert got_a == [approx(t) for t in (t1, t2, t3, t4, t5, t6)]
    assert got_b == [approx(t) for t in (t4, t5, t6)]
    # and the engine agrees
    oracle_a, oracle_b = engine_oracle(dep, [(0.0, P, 6), (t2, P, 3)])
    assert got_a == [approx(t) for t in oracle_a]
    assert got_b == [approx(t) for t in oracle_b]


async def test_a_stalled_reader_does_not_slow_another_stream(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A stops reading after its first token (its writer blocks on a full transport); B,
    arriving then, is paced exactly as the engine prices the shared batch, and A's frames
    keep accumulating in its own buffer."""
    settings = make_settings()
    dep = settings.deployments[0]
    async with serve(settings) as s:
        t0 = trio.current_time()
        async with s.stream(chat_body(max_tokens=200, stream=True)) as a:
            while not a.token_times():
                await a.next_chunk()
            t_b = trio.current_time() - t0
            async with s.stream(chat_body(max_tokens=40, stream=True)) as b:
                got_b = await timed_stream(b, t0)
            running = s.runtime().snapshot().running
            emitted = s.runtime().engine.statistics().steps
    _, oracle_b = engine_oracle(dep, [(0.0, P, 200), (t_b, P, 40)])
    assert got_b == [approx(t) for t in oracle_b]
    assert running == 1  # A is still generating, unread
    assert emitted > 40


async def test_pacing_lag_is_zero_on_a_virtual_clock(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve() as s:
        for _ in range(3):
            await s.post("/v1/chat/completions", chat_body(max_tokens=20))
        snap = s.runtime().snapshot()
    assert snap.events > 20
    assert snap.lag_max == 0.0 and snap.lag_mean == 0.0


async def test_a_stream_longer_than_a_minute_is_not_cut(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Quart cuts responses at 60 s unless the response disables its timeout: a 70-second
    stream (Llama-3-70B decodes at ~17.5 ms per token on one B200) ends with [DONE]."""
    settings = make_settings("Llama-3-70B")
    async with serve(settings) as s:
        body = chat_body(model="Llama-3-70B", max_tokens=4000, stream=True)
        t0 = trio.current_time()
        async with s.stream(body) as stream:
            await stream.read_all()
        assert trio.current_time() - t0 > 65
    assert stream.frames()[-1] == b"[DONE]"
    assert len(stream.token_times()) == 4000


class StepSpy:
    """Wraps an Engine and records, per request id, the simulated times its tokens were
    emitted (the runtime's engine may be replaced)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.emitted: dict[int, list[float]] = {}
        self.submitted: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def submit(self, spec: RequestSpec) -> int:
        rid = self._engine.submit(spec)
        self.submitted.append(rid)
        return rid

    def step(self) -> object:
        events = self._engine.step()
        for rid, count in events.tokens:
            self.emitted.setdefault(rid, []).extend([events.time] * count)
        return events


async def test_held_back_writes_batch_mid_stream_tokens_but_never_the_ends(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """While delivery holds writes back (a saturated loop; here forced to 3.2 ms, about two
    steps, beside 39 other streams), a writer batches mid-stream tokens, but a stream's
    first token and its end ([DONE]) leave exactly when the engine emits them: TTFT and
    E2E are untouched."""
    async with serve() as s:
        s.state.delivery.force_interval(0.0032)
        rt = s.runtime()
        spy = StepSpy(rt.engine)
        rt.engine = spy  # type: ignore[assignment]
        async with trio.open_nursery() as nursery:
            for _ in range(39):

                async def background() -> None:
                    async with s.stream(chat_body(max_tokens=400, stream=True)) as st:
                        await st.read_all()

                nursery.start_soon(background)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.snapshot().running == 39
            async with s.stream(chat_body(max_tokens=60, stream=True)) as b:
                await b.read_all()
            nursery.cancel_scope.cancel()
        emitted = spy.emitted[spy.submitted[-1]]
        assert s.state.delivery.statistics().holds > 0
    assert len(emitted) == 60 == len(b.token_times())
    assert b.token_times()[0] == approx(rt.epoch + emitted[0])
    assert b.chunks[-1][0] == approx(rt.epoch + emitted[-1])
    assert b.frames()[-1] == b"[DONE]"
    token_writes = [t for t, data in b.chunks if b'"content"' in data]
    assert len(token_writes) < 60 / 2  # two or more tokens per write mid-stream


async def test_an_idle_loop_writes_every_token_when_it_is_emitted(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With no hold-back (the loop is not saturated) each decode step's token is its own
    write, at the step's end."""
    async with serve() as s, s.stream(chat_body(max_tokens=30, stream=True)) as stream:
        await stream.read_all()
    token_writes = [t for t, data in stream.chunks if b'"content"' in data]
    assert len(token_writes) == 30


class TimedSink:
    """Records the virtual times at which the engine hands a request its tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = trio.Event()

    def on_tokens(self, count: int) -> None:
        self.times.extend([trio.current_time()] * count)

    def on_finished(self, finished: object) -> None:
        self.done.set()

    def on_failed(self, message: str) -> None:
        self.done.set()


async def test_a_request_handed_over_after_the_boundary_it_arrived_before_joins_that_step(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The server stamps a request when it receives it and hands it to the engine a
    little later: one that arrived before a step boundary but reached the engine after it
    still joins that step (its tokens come when the on-time engine oracle says)."""
    settings = make_settings()
    dep = settings.deployments[0]
    async with serve(settings) as s:
        rt = s.runtime()
        first = TimedSink()
        rt.admit_nowait(prompt_tokens=40, max_tokens=30, priority=0, sink=first)
        a_at = trio.current_time() - rt.epoch
        # the start of A's third step, in simulated time
        eng = Engine(dep)
        eng.advance_to(a_at)
        eng.submit(RequestSpec(40, 30, arrival_time=a_at))
        starts = []
        while eng.next_event_time() is not None:
            ev = eng.step()
            if ev.step is not None:
                starts.append(ev.step.start)
        boundary = starts[2]
        await trio.sleep_until(rt.epoch + boundary + 1e-5)  # the boundary was handled
        late = TimedSink()
        stamp = boundary - 1e-6
        rt.admit_nowait(
            prompt_tokens=25, max_tokens=5, priority=0, sink=late, arrival=rt.epoch + stamp
        )
        await late.done.wait()
        await first.done.wait()
    expected = engine_oracle(dep, [(a_at, 40, 30), (stamp, 25, 5)])
    assert [t - rt.epoch for t in late.times] == [approx(t) for t in expected[1]]
    assert [t - rt.epoch for t in first.times] == [approx(t) for t in expected[0]]


class _LagLog(logging.Handler):
    """The runtime's pacing-lag warnings, each with the virtual time it was logged at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "pacing lag" in message:
            self.records.append((trio.current_time(), message))


async def _make_late(
    runtime: ModelRuntime, clock: trio.testing.MockClock, lag: float, done: trio.Event
) -> None:
    """Until ``done``: whenever the engine has an event ahead, jump the virtual clock to
    ``lag`` past it, as a stalled CPU would; the engine then handles it exactly ``lag``
    late (and what else fell due meanwhile, less late)."""
    while not done.is_set():
        t = runtime.engine.next_event_time()
        if t is not None:
            ahead = runtime.epoch + t + lag - trio.current_time()
            if ahead > 0:
                clock.jump(ahead)
        await trio.sleep(1e-6)


async def _run_late(s: Any, lag: float, max_tokens: int) -> None:
    """One Llama-3-70B request (17.5 ms decode steps) whose events are all ``lag`` late."""
    done = trio.Event()
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_make_late, s.runtime("Llama-3-70B"), clock, lag, done)
        body = chat_body(max_tokens=max_tokens, model="Llama-3-70B")
        response = await s.post("/v1/chat/completions", body)
        assert response.status_code == 200
        done.set()


def _lag_entry(stats: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [m for m in stats["models"] if m["model"] == "Llama-3-70B"]
    lag: dict[str, Any] = entry["pacing_lag_ms"]
    return lag


async def test_late_events_are_measured_and_warned_about_once_per_ten_seconds(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Events handled 20 ms late (a CPU that stalls before each one) show as pacing lag in
    the runtime and in ``/control/stats``, and the log says so: a warning naming the
    model and the last second's p99, at most once per LAG_WARN_EVERY."""
    log = _LagLog()
    logging.getLogger("inference_lab.serve").addHandler(log)
    try:
        async with serve(make_settings("Llama-3-70B")) as s:
            start = trio.current_time()
            await _run_late(s, 0.020, max_tokens=1400)  # ~24.5 s of decode steps
            elapsed = trio.current_time() - start
            snap = s.runtime("Llama-3-70B").snapshot()
            status, stats = await s.get_json("/control/stats")
    finally:
        logging.getLogger("inference_lab.serve").removeHandler(log)
    assert status == 200
    assert 21.0 < elapsed < 31.0  # three warnings' worth of windows, not four
    assert snap.lag_max == pytest.approx(0.020, rel=1e-9)
    assert 0.0 < snap.lag_mean < 0.020
    lag = _lag_entry(stats)
    assert lag["max"] == pytest.approx(20.0, abs=1e-3)
    assert lag["last_second_p99"] == pytest.approx(20.0, abs=1e-3)
    assert lag["window_p99"] == pytest.approx(20.0, abs=1e-3)
    times = [t for t, _ in log.records]
    assert len(times) == 3, log.records
    assert all(b - a >= LAG_WARN_EVERY for a, b in zip(times, times[1:], strict=False))
    assert times[0] - start <= LAG_WINDOW + 0.1  # the first late second already warns
    for _, message in log.records:
        assert message.startswith("Llama-3-70B: pacing lag p99 20.00 ms (max 20.00 ms)")


async def test_lag_under_the_warning_threshold_is_measured_but_not_warned_about(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    lag_s = LAG_WARN_P99 * 0.8
    log = _LagLog()
    logging.getLogger("inference_lab.serve").addHandler(log)
    try:
        async with serve(make_settings("Llama-3-70B")) as s:
            await _run_late(s, lag_s, max_tokens=200)  # ~3.5 s: three windows closed
            status, stats = await s.get_json("/control/stats")
    finally:
        logging.getLogger("inference_lab.serve").removeHandler(log)
    assert status == 200
    lag = _lag_entry(stats)
    assert lag["last_second_p99"] == pytest.approx(lag_s * 1e3, abs=1e-3)
    assert lag["max"] == pytest.approx(lag_s * 1e3, abs=1e-3)
    assert log.records == []


#: How late the fake pacer timer lands: 2**-12 s (0.24 ms, under MAX_EARLY) is exact in
#: binary, so deadlines moved by it stay exact and the virtual times compare exactly.
TIMER_LATE = 2.0**-12
#: How long before it reaches the runtime a request was stamped (less than a prefill).
BACKDATED = 0.0001


class _LateTimer:
    """The pacer's timer as this stack's real one behaves, on the MockClock: precise (so
    the runtime calibrates its early wake) and landing TIMER_LATE after each deadline."""

    made: list[_LateTimer] = []

    def __init__(self) -> None:
        self.precise = True
        self.wakes = 0
        _LateTimer.made.append(self)

    async def sleep_until(self, deadline: float) -> None:
        await trio.sleep_until(deadline + TIMER_LATE)
        self.wakes += 1  # a wake-up (a sleep the engine cancelled is none)

    def close(self) -> None:
        pass


class _Finish:
    """A sink that only waits for its request's end."""

    def __init__(self) -> None:
        self.ended = trio.Event()

    def on_tokens(self, count: int) -> None:
        pass

    def on_finished(self, finished: Any) -> None:
        self.ended.set()

    def on_failed(self, message: str) -> None:
        self.ended.set()


async def _lone_request(
    monkeypatch: pytest.MonkeyPatch, adopt: PacingCalibration | None
) -> tuple[ModelRuntime, int]:
    """A 20-token request into an idle runtime whose pacer timer lands TIMER_LATE late,
    stamped BACKDATED before it reaches the runtime (as a server stamps it on receipt);
    the runtime (stopped) and its timer's wake-ups."""
    _LateTimer.made.clear()
    monkeypatch.setattr(runtime_module, "Timer", _LateTimer)
    rt = ModelRuntime(make_settings().deployments[0])
    if adopt is not None:
        rt.adopt_calibration(adopt)
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.run)
        await trio.sleep(1.0)
        sink = _Finish()
        arrival = trio.current_time() - BACKDATED
        rt.admit_nowait(prompt_tokens=P, max_tokens=20, priority=0, sink=sink, arrival=arrival)
        await sink.ended.wait()
        rt.stop()
    (timer,) = _LateTimer.made
    return rt, timer.wakes


async def test_the_early_wake_is_learned_from_the_timers_wake_ups_only(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A fresh runtime learns how late its timer lands from its first wake-up on (the
    first samples are averaged evenly), and only from timer wake-ups: the back-dated
    arrival's first step, due when the arrival reaches the engine, is not a sample. Only
    the first token, before anything was learned, is released late."""
    rt, wakes = await _lone_request(monkeypatch, adopt=None)
    calibration = rt.calibration()
    assert wakes >= 10
    assert calibration == PacingCalibration(TIMER_LATE, wakes)
    assert rt.statistics().calibration == calibration
    snap = rt.snapshot()
    assert snap.lag_max == TIMER_LATE
    # only the first token was late: the back-dated arrival and its first step's start,
    # due before the engine could know of them, release nothing (runtime Rule 2)
    assert snap.lag_mean * snap.events == pytest.approx(TIMER_LATE)
    assert snap.events == 20  # one per step that released a token


async def test_a_runtime_that_adopts_a_calibration_is_on_time_from_its_first_token(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Started from what another runtime learned on the same machine (the server's
    warm-up), the pacer wakes early enough from its first wake-up: every step's tokens
    are released on time, so the pacing lag is 0: the request's way in (stamped
    BACKDATED before the engine took it) is inside its first step, which starts at the
    stamp, and is not lateness (runtime Rule 2)."""
    learned = PacingCalibration(TIMER_LATE, 8)
    rt, wakes = await _lone_request(monkeypatch, adopt=learned)
    assert rt.calibration() == PacingCalibration(TIMER_LATE, 8 + wakes)
    snap = rt.snapshot()
    assert snap.lag_max == 0.0 and snap.lag_mean == 0.0
    assert snap.events == 20


async def test_a_way_in_longer_than_the_first_step_makes_its_tokens_late(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A request stamped a whole second before the engine takes it: its first step
    (starting at the stamp) ended long before, so its first token leaves late by the
    second less the modelled TTFT, and that is pacing lag (a client sees it)."""
    _LateTimer.made.clear()
    monkeypatch.setattr(runtime_module, "Timer", _LateTimer)
    rt = ModelRuntime(make_settings().deployments[0])
    rt.adopt_calibration(PacingCalibration(TIMER_LATE, 8))
    seen: list[Any] = []

    class _Keep(_Finish):
        def on_finished(self, finished: Any) -> None:
            seen.append(finished)
            super().on_finished(finished)

    async with trio.open_nursery() as nursery:
        await nursery.start(rt.run)
        await trio.sleep(1.0)
        sink = _Keep()
        rt.admit_nowait(
            prompt_tokens=P, max_tokens=20, priority=0, sink=sink,
            arrival=trio.current_time() - 1.0,
        )  # fmt: skip
        await sink.ended.wait()
        rt.stop()
    (finished,) = seen
    ttft = finished.first_token_time - finished.arrival_time
    assert 0.0 < ttft < 0.1
    assert rt.snapshot().lag_max == pytest.approx(1.0 - ttft, abs=1e-9)


#: How long the engine's every step takes to compute in the test below (exact in binary).
STEP_COMPUTE = 2.0**-13


async def test_the_early_wake_covers_the_steps_computation_too(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Runtime Rule 2: a sample is how late a timer wake-up's step had been computed, its
    tokens ready to leave, so the early wake learns the timer's lateness and the step's
    own computation (here each ``step()`` takes STEP_COMPUTE of virtual time): after the
    first wake-up every step's tokens are ready at its due time."""
    real_step = Engine.step

    def slow_step(engine: Engine) -> Any:
        autojump_clock.jump(STEP_COMPUTE)
        return real_step(engine)

    monkeypatch.setattr(Engine, "step", slow_step)
    rt, wakes = await _lone_request(monkeypatch, adopt=None)
    calibration = rt.calibration()
    assert wakes >= 10
    assert calibration.samples == wakes
    assert calibration.early == pytest.approx(TIMER_LATE + STEP_COMPUTE, rel=0.02)
    assert TIMER_LATE + STEP_COMPUTE < MAX_EARLY


def test_an_adopted_calibration_is_kept_within_bounds() -> None:
    rt = ModelRuntime(make_settings().deployments[0])
    rt.adopt_calibration(PacingCalibration(1.0, 3))
    assert rt.calibration() == PacingCalibration(MAX_EARLY, 3)
    rt.adopt_calibration(PacingCalibration(-1.0, -2))
    assert rt.calibration() == PacingCalibration(0.0, 0)


async def test_a_restarted_engine_keeps_the_calibration_and_stats_show_it(
    serve: ServeFactory,
) -> None:
    async with serve() as s:
        s.runtime().adopt_calibration(PacingCalibration(TIMER_LATE, 12))
        fresh = await s.state.restart_runtime(GPT)
        assert fresh.calibration() == PacingCalibration(TIMER_LATE, 12)
        status, stats = await s.get_json("/control/stats")
    assert status == 200
    (entry,) = stats["models"]
    assert entry["pacing_lag_ms"]["early_wake"] == round(TIMER_LATE * 1e3, 4)
    assert entry["pacing_lag_ms"]["early_wake_samples"] == 12


class OrderSink:
    """Logs (virtual time, name) each time the engine hands it tokens, into a shared log."""

    def __init__(self, name: str, log: list[tuple[float, str]]) -> None:
        self.name = name
        self.log = log
        self.done = trio.Event()
        self.decoding = trio.Event()  # set at its third hand-over

    def on_tokens(self, count: int) -> None:
        self.log.append((trio.current_time(), self.name))
        if sum(1 for _, name in self.log if name == self.name) == 3:
            self.decoding.set()

    def on_finished(self, finished: object) -> None:
        self.done.set()

    def on_failed(self, message: str) -> None:
        self.done.set()


async def test_a_first_token_is_handed_over_before_the_steps_mid_stream_tokens(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Runtime Rule 9: in the step where B's prefill ends, A (admitted earlier, decoding)
    also gets a token; B's first token is handed over first, A's after it."""
    log: list[tuple[float, str]] = []
    async with serve() as s:
        rt = s.runtime()
        a = OrderSink("A", log)
        rt.admit_nowait(prompt_tokens=40, max_tokens=40, priority=0, sink=a)
        await a.decoding.wait()
        b = OrderSink("B", log)
        rt.admit_nowait(prompt_tokens=30, max_tokens=5, priority=0, sink=b)
        await b.done.wait()
        await a.done.wait()
    first_b = next(i for i, (_, name) in enumerate(log) if name == "B")
    at = log[first_b][0]
    same_step = [name for t, name in log if t == at]
    assert same_step == ["B", "A"]
