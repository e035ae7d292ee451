"""Exact admission (``inference_lab/core/admission.py``) and the 529's ``Retry-After``.

A request is refused only when it has neither a seat in the running batch of its replica
nor a waiting place; the count admitted from a burst does not depend on when the engine
steps. Every test runs on trio's MockClock, so step times are the model's, exactly.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from inference_lab.core.config import Deployment
from inference_lab.core.engine import RequestSpec
from inference_lab.errors import QueueFull
from inference_lab.runtime.model_runtime import ModelRuntime
from tests.conftest import GPT, ServeFactory, chat_body, make_settings


class Sink:
    """Counts what the engine hands a request; :meth:`wait` for a count."""

    def __init__(self) -> None:
        self.tokens = 0
        self.finished = False
        self.failed: str | None = None
        self._lot = trio.lowlevel.ParkingLot()

    def on_tokens(self, count: int) -> None:
        self.tokens += count
        self._lot.unpark_all()

    def on_finished(self, finished: Any) -> None:
        self.finished = True
        self._lot.unpark_all()

    def on_failed(self, message: str) -> None:
        self.failed = message
        self._lot.unpark_all()

    async def wait(self, tokens: int) -> None:
        """Until this many tokens arrived or the request ended."""
        while self.tokens < tokens and not self.finished and self.failed is None:
            await self._lot.park()


def deployment(**scheduler: Any) -> Deployment:
    return make_settings(**scheduler).deployments[0]


def burst(rt: ModelRuntime, count: int, max_tokens: int = 1000) -> list[Sink | None]:
    """``count`` simultaneous arrivals (no checkpoint between them): each one's sink, or
    None where it was refused."""
    out: list[Sink | None] = []
    for _ in range(count):
        sink = Sink()
        try:
            rt.admit_nowait(prompt_tokens=50, max_tokens=max_tokens, priority=0, sink=sink)
        except QueueFull:
            out.append(None)
        else:
            out.append(sink)
    return out


def admitted(sinks: list[Sink | None]) -> int:
    return sum(s is not None for s in sinks)


async def running_runtime(nursery: trio.Nursery, dep: Deployment) -> ModelRuntime:
    rt = ModelRuntime(dep)
    await nursery.start(rt.run)
    return rt


@pytest.mark.parametrize(("seqs", "waiting"), [(2, 2), (16, 8), (4, 64)])
async def test_a_burst_into_an_idle_model_admits_exactly_seats_plus_places(
    seqs: int, waiting: int, autojump_clock: trio.testing.MockClock
) -> None:
    """N simultaneous arrivals into an idle model admit min(N, max_num_seqs + max_waiting):
    the first max_num_seqs take seats (the batch is free), the next max_waiting take
    waiting places, the rest are refused; once stepped, they run and wait as counted."""
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, deployment(max_num_seqs=seqs, max_waiting=waiting))
        total = seqs + waiting
        sinks = burst(rt, total + 10)
        assert admitted(sinks) == total
        assert sinks[total:] == [None] * 10
        assert rt.snapshot().depth == waiting
        assert rt.snapshot().refused == 10
        await trio.testing.wait_all_tasks_blocked()
        snap = rt.snapshot()
        assert (snap.running, snap.waiting, snap.pending, snap.depth) == (
            seqs,
            waiting,
            0,
            waiting,
        )
        assert admitted(burst(rt, 3)) == 0
        rt.stop()


@pytest.mark.parametrize("first", [1, 5, 17])
async def test_arrivals_between_and_within_steps_admit_the_same_count(
    first: int, autojump_clock: trio.testing.MockClock
) -> None:
    """A burst split around the engine's steps -- some arrive, the engine steps them into
    its batch and queue, the rest arrive mid-step and later -- admits exactly as many as
    one simultaneous burst (seats 16 + places 8)."""
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, deployment(max_num_seqs=16, max_waiting=8))
        count = admitted(burst(rt, first))
        await trio.testing.wait_all_tasks_blocked()  # stepped in: a step is in flight
        await trio.sleep(0.0001)  # within that step (a prefill step lasts longer)
        count += admitted(burst(rt, 3))
        await trio.sleep(0.01)  # a few steps later
        count += admitted(burst(rt, 40))
        assert count == 24
        await trio.sleep(0.01)  # the last arrivals' seats are taken at the next boundary
        assert (rt.snapshot().running, rt.snapshot().depth) == (16, 8)
        rt.stop()


async def test_a_finished_request_frees_a_seat_that_the_next_arrival_takes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With the batch and the queue full, a request that finishes lets the head of the
    queue into the batch: exactly one more arrival is admitted, as a waiting place."""
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, deployment(max_num_seqs=2, max_waiting=2))
        short = burst(rt, 1, max_tokens=3)
        assert admitted(short + burst(rt, 3)) == 4
        assert admitted(burst(rt, 1)) == 0
        sink = short[0]
        assert sink is not None
        await sink.wait(3)
        await trio.testing.wait_all_tasks_blocked()
        assert admitted(burst(rt, 5)) == 1
        rt.stop()


async def test_live_capacity_changes_move_the_count_and_lowering_seqs_never_evicts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Lowering max_num_seqs leaves every running request running (it drains) and takes
    no seat from them: arrivals then only get waiting places. Raising max_waiting admits
    that many more at once; raising max_num_seqs gives seats again."""
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, deployment(max_num_seqs=16, max_waiting=8))
        assert admitted(burst(rt, 16)) == 16
        await trio.testing.wait_all_tasks_blocked()
        rt.set_capacity(max_num_seqs=4)
        assert rt.snapshot().running == 16
        assert admitted(burst(rt, 20)) == 8  # places only: no seat below the new cap
        await trio.testing.wait_all_tasks_blocked()
        assert (rt.snapshot().running, rt.snapshot().depth) == (16, 8)
        rt.set_capacity(max_waiting=10)
        assert admitted(burst(rt, 5)) == 2
        rt.set_capacity(max_num_seqs=20)  # 4 seats free again; the queue's head takes them
        await trio.testing.wait_all_tasks_blocked()
        assert admitted(burst(rt, 5)) == 4
        rt.stop()


async def test_kv_that_cannot_hold_a_first_chunk_gives_no_seat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Seats need the KV blocks the scheduler would allocate: with room for three first
    chunks, a burst gets three seats and max_waiting places, not max_num_seqs seats."""
    dep = deployment(max_num_seqs=16, max_waiting=4)
    probe = RequestSpec(prompt_tokens=50, max_tokens=100)
    need = ModelRuntime(dep).engine.first_chunk_blocks(probe, 0)  # content and windowed
    kv = (3 * need + need - 1) * dep.block_bytes  # room for 3 first chunks, not 4
    small = attrs.evolve(dep, scheduler=attrs.evolve(dep.scheduler, kv_cache_capacity=kv))
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, small)
        assert rt.engine.roofline.total_blocks == 4 * need - 1
        assert admitted(burst(rt, 20, max_tokens=100)) == 3 + 4
        rt.stop()


async def test_replicas_count_seats_on_the_replica_the_router_chooses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two replicas behind a round robin, 2 seats each and 2 waiting places: 6 admitted;
    each replica runs the 2 it was routed, and the arrivals keep their replica."""
    dep = deployment(max_num_seqs=2, max_waiting=2)
    two = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, replicas=2))
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, two)
        assert admitted(burst(rt, 12)) == 6
        await trio.testing.wait_all_tasks_blocked()
        workers = rt.engine.statistics().workers
        assert [w.running for w in workers] == [2, 2]
        assert sum(w.waiting for w in workers) == 2
        assert rt.snapshot().depth == 2
        rt.stop()


async def test_http_burst_is_exact(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Through the app: 30 simultaneous streams into seqs 16 / waiting 8 get exactly 24
    200s and 6 529s whose depth reads 8 (the issue's first signal)."""
    async with serve(make_settings(max_num_seqs=16, max_waiting=8)) as s:
        statuses: list[int] = []
        bodies: list[bytes] = []

        async def one() -> None:
            async with s.stream(chat_body(max_tokens=500, stream=True)) as st:
                await st.next_chunk()
                assert st.status is not None
                statuses.append(st.status)
                if st.status == 529:
                    bodies.append(st.body_bytes())
                await st.disconnect()

        async with trio.open_nursery() as nursery:
            for _ in range(30):
                nursery.start_soon(one)
        assert sorted(statuses) == [200] * 24 + [529] * 6
        for body in bodies:
            message = json.loads(body)["error"]["message"]
            assert "8 requests waiting (max_waiting = 8)" in message


async def test_retry_after_is_the_time_until_the_first_running_request_finishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Hand computation: gpt-oss-20b on b200, one request of a 90-token prompt running
    with 40 tokens to produce, steps slowed 1000x. After its 10th token the step in
    flight (context 100: 0.4477 ms, the roofline's reference value, so 0.4477 s here)
    emits token 11, then 29 decode steps of ~0.448 s each: it finishes ~13.4 s from the
    step's start. A refusal then says 14; later, fewer."""
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, deployment(max_num_seqs=1, max_waiting=1))
        rt.set_step_time_factor(1000.0)
        sink = Sink()
        rt.admit_nowait(prompt_tokens=90, max_tokens=40, priority=0, sink=sink)
        assert admitted(burst(rt, 1)) == 1  # the waiting place
        await sink.wait(10)
        # the engine handled token 10's boundary a moment ago: the next step just started
        with pytest.raises(QueueFull) as refused:
            rt.admit_nowait(prompt_tokens=5, max_tokens=5, priority=0, sink=Sink())
        step = 0.4477
        assert refused.value.retry_after == math.ceil(30 * step) == 14
        await trio.sleep(8.0)
        with pytest.raises(QueueFull) as later:
            rt.admit_nowait(prompt_tokens=5, max_tokens=5, priority=0, sink=Sink())
        assert later.value.retry_after == 6
        rt.stop()


async def test_retry_after_of_a_full_but_fast_model_is_one_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An idle server that fills up at once refuses with Retry-After 1 (its running
    requests finish in milliseconds), not a window of past completions."""
    async with trio.open_nursery() as nursery:
        rt = await running_runtime(nursery, deployment(max_num_seqs=2, max_waiting=1))
        burst(rt, 3, max_tokens=10)
        with pytest.raises(QueueFull) as refused:
            rt.admit_nowait(prompt_tokens=5, max_tokens=5, priority=0, sink=Sink())
        assert refused.value.retry_after == 1
        rt.stop()


async def test_should_retry_header_can_be_left_off(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """By default a 529 says x-should-retry: false; with --no-should-retry-header it does
    not (Retry-After stays)."""
    for flag, expected in ((True, "false"), (False, None)):
        settings = attrs.evolve(
            make_settings(max_num_seqs=1, max_waiting=1), should_retry_header=flag
        )
        async with serve(settings) as s:
            async with (
                s.stream(chat_body(max_tokens=50, stream=True)) as a,
                s.stream(chat_body(max_tokens=50, stream=True)) as b,
            ):
                await a.next_chunk()
                response = await s.post("/v1/chat/completions", chat_body())
                assert response.status_code == 529
                assert response.headers.get("x-should-retry") == expected
                assert response.headers["retry-after"] == "1"
                s.runtime().stop()
                await a.read_all()
                await b.read_all()


async def test_aborted_requests_are_counted(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A stream whose client leaves is counted as aborted in /control/stats and as
    vllm:request_success_total{finished_reason="abort"}."""
    async with serve() as s:
        async with s.stream(chat_body(max_tokens=500, stream=True)) as st:
            await st.next_chunk()
            await st.next_chunk()
        await trio.testing.wait_all_tasks_blocked()
        status, stats = await s.get_json("/control/stats")
        assert stats["models"][0]["aborted"] == 1
        response = await s.client.get("/metrics")
        text = (await response.get_data()).decode()
        assert (
            f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{GPT}"}} 1.0'
            in text
        )


async def test_a_killed_engine_reports_no_load(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """After its engine dies a model's gauges read zero running, waiting and KV, and
    engine_alive 0 -- not the load it had when it died."""
    async with serve(make_settings(max_num_seqs=4)) as s:
        async with (
            s.stream(chat_body(max_tokens=500, stream=True)) as a,
            s.stream(chat_body(max_tokens=500, stream=True)) as b,
        ):
            await a.next_chunk()
            await b.next_chunk()
            assert s.runtime().snapshot().running == 2
            s.runtime().kill()
            await a.read_all()
            await b.read_all()
        response = await s.client.get("/metrics")
        text = (await response.get_data()).decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "inference_lab:engine_alive",
    ):
        engine = "" if name.startswith("inference_lab:") else 'engine="0",'
        assert f'{name}{{{engine}model_name="{GPT}"}} 0.0' in text, name
