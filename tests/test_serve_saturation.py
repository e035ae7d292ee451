"""Saturation and capacity (``docs/saturation.md``): the waiting bound, HTTP 529, the
pending count, and ``/control/capacity``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from inference_lab.core.roofline import Roofline
from inference_lab.errors import EngineUnavailable
from inference_lab.runtime.model_runtime import ModelRuntime
from tests.conftest import GPT, LLAMA, ServeFactory, Stream, chat_body, make_settings

P = 5


class NullSink:
    def on_tokens(self, count: int) -> None:
        pass

    def on_finished(self, finished: Any) -> None:
        pass

    def on_failed(self, message: str) -> None:
        pass


def saturated_body(depth: int, bound: int) -> bytes:
    message = (
        f"Server is at capacity: {depth} requests waiting (max_waiting = {bound}). "
        "Retry with reduced concurrency."
    )
    return (
        f'{{"error":{{"message":"{message}","type":"overloaded_error","code":"queue_saturated"}}}}'
    ).encode()


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def fill_batch(stream: Stream) -> None:
    """Wait until ``stream`` runs (its first token arrived)."""
    while not stream.token_times():
        assert await stream.next_chunk() is not None


class DepthWatch(trio.abc.Instrument):
    """Records a runtime's published depth after every task step."""

    def __init__(self, rt: ModelRuntime) -> None:
        self.rt = rt
        self.depths: list[int] = []
        self.running: list[int] = []

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        snap = self.rt.snapshot()
        if not self.depths or self.depths[-1] != snap.depth:
            self.depths.append(snap.depth)
        if not self.running or self.running[-1] != snap.running:
            self.running.append(snap.running)


# -- the bound ------------------------------------------------------------------------------


async def test_burst_admits_exactly_max_waiting_and_refuses_the_rest(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """12 simultaneous arrivals against max_waiting = 4 with the batch full: exactly 4 are
    queued, 8 get the exact 529 (JSON, x-should-retry: false, never an event stream);
    every admitted one completes with [DONE]; admission reopens after the drain."""
    bound, burst = 4, 12
    async with serve(make_settings(max_num_seqs=1, max_waiting=bound)) as s:
        rt = s.runtime()
        watch = DepthWatch(rt)
        results: list[Stream] = []
        async with s.stream(chat_body(max_tokens=30, stream=True)) as running:
            await fill_batch(running)
            trio.lowlevel.add_instrument(watch)

            async def arrive() -> None:
                async with s.stream(chat_body(max_tokens=3, stream=True)) as st:
                    await st.read_all()
                    results.append(st)

            async with trio.open_nursery() as nursery:
                for _ in range(burst):
                    nursery.start_soon(arrive)
                await settle()
                assert rt.snapshot().depth == bound
                await running.read_all()
            trio.lowlevel.remove_instrument(watch)
        admitted = [r for r in results if r.status == 200]
        refused = [r for r in results if r.status == 529]
        assert (len(admitted), len(refused)) == (bound, burst - bound)
        for r in admitted:
            assert r.headers["content-type"] == "text/event-stream"
            assert r.frames()[-1] == b"[DONE]"
        for r in refused:
            assert r.headers["content-type"] == "application/json"
            assert r.headers["x-should-retry"] == "false"
            assert r.body_bytes() == saturated_body(bound, bound)
        assert max(watch.depths) == bound
        # admission reopens once the queue drained
        response = await s.post("/v1/chat/completions", chat_body(max_tokens=2))
        assert response.status_code == 200
        assert rt.snapshot().refused == burst - bound


async def test_depth_never_breathes_while_arrivals_move_into_the_queue(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With the batch full nobody leaves the queue, so the published depth (waiting +
    pending) only rises as a burst is admitted and stepped in: a pending slot is released
    only after the waiting count that replaces it is published."""
    async with serve(make_settings(max_num_seqs=1)) as s:
        rt = s.runtime()
        watch = DepthWatch(rt)
        async with s.stream(chat_body(max_tokens=40, stream=True)) as running:
            await fill_batch(running)
            trio.lowlevel.add_instrument(watch)
            async with trio.open_nursery() as nursery:
                for _ in range(10):

                    async def arrive() -> None:
                        async with s.stream(chat_body(max_tokens=2, stream=True)) as st:
                            await st.next_chunk()
                            await settle()

                    nursery.start_soon(arrive)
                await settle()
                assert rt.snapshot().depth == 10
                trio.lowlevel.remove_instrument(watch)
        rising = watch.depths[: watch.depths.index(10) + 1]
        assert rising == sorted(rising)
        assert rising[-1] == 10


async def test_unbounded_queue_never_refuses_and_reports_true_depth(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(max_num_seqs=1, max_waiting=0)) as s:
        async with s.stream(chat_body(max_tokens=20, stream=True)) as running:
            await fill_batch(running)
            streams = []
            async with trio.open_nursery() as nursery:
                for _ in range(25):

                    async def arrive() -> None:
                        async with s.stream(chat_body(max_tokens=1, stream=True)) as st:
                            await st.read_all()
                            streams.append(st)

                    nursery.start_soon(arrive)
                await settle()
                status, body = await s.get_json("/control/capacity")
                assert body == [
                    {
                        "model": GPT,
                        "max_waiting": 0,
                        "max_num_seqs": 1,
                        "waiting": 25,
                        "queued": 25,
                        "running": 1,
                    }
                ]
                await running.read_all()
        assert [st.status for st in streams] == [200] * 25
        assert s.runtime().snapshot().refused == 0


async def test_raising_and_lowering_the_bound_applies_to_new_arrivals_only(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(max_num_seqs=1, max_waiting=2)) as s:
        async with s.stream(chat_body(max_tokens=40, stream=True)) as running:
            await fill_batch(running)
            async with trio.open_nursery() as nursery:
                queued: list[Stream] = []

                async def arrive() -> None:
                    async with s.stream(chat_body(max_tokens=2, stream=True)) as st:
                        await st.read_all()
                        queued.append(st)

                for _ in range(2):
                    nursery.start_soon(arrive)
                await settle()
                assert (await s.post("/v1/chat/completions", chat_body())).status_code == 529
                response = await s.post("/control/capacity", {"max_waiting": 4})
                assert json.loads(await response.get_data())[0]["max_waiting"] == 4
                for _ in range(2):
                    nursery.start_soon(arrive)
                await settle()
                assert s.runtime().snapshot().depth == 4
                await s.post("/control/capacity", {"max_waiting": 1})
                refused = await s.post("/v1/chat/completions", chat_body())
                assert refused.status_code == 529
                assert await refused.get_data() == saturated_body(4, 1)
                await running.read_all()
        assert [st.status for st in queued] == [200] * 4
        assert all(st.frames()[-1] == b"[DONE]" for st in queued)


# -- max_num_seqs -----------------------------------------------------------------------------


async def test_lowering_max_num_seqs_drains_without_evicting(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Cap 4 -> 2 with 4 running: all 4 run to completion (no cancellation) and the
    running count falls step by step; a waiting request is admitted only once fewer than
    2 run (after the third finishes), not after the first as the old cap would allow."""
    async with serve(make_settings(max_num_seqs=4)) as s:
        rt = s.runtime()
        watch = DepthWatch(rt)
        streams: dict[str, Stream] = {}

        async def run(name: str, max_tokens: int) -> None:
            async with s.stream(chat_body(max_tokens=max_tokens, stream=True)) as st:
                streams[name] = st
                await st.read_all()

        async with trio.open_nursery() as nursery:
            for name, n in (("a", 10), ("b", 20), ("c", 30), ("d", 40)):
                nursery.start_soon(run, name, n)
            await settle()
            assert rt.snapshot().running == 4
            for name in ("w1", "w2"):
                nursery.start_soon(run, name, 5)
            await settle()
            response = await s.post("/control/capacity", {"max_num_seqs": 2})
            body = json.loads(await response.get_data())
            assert body == [
                {
                    "model": GPT,
                    "max_waiting": 0,
                    "max_num_seqs": 2,
                    "waiting": 2,
                    "queued": 2,
                    "running": 4,
                }
            ]
            trio.lowlevel.add_instrument(watch)
        trio.lowlevel.remove_instrument(watch)
        for st in streams.values():
            assert json.loads(st.frames()[-2])["choices"][0]["finish_reason"] == "length"
            assert st.frames()[-1] == b"[DONE]"
        assert [len(streams[n].token_times()) for n in "abcd"] == [10, 20, 30, 40]
        first, second = sorted((streams["w1"], streams["w2"]), key=lambda st: st.token_times()[0])
        assert first.token_times()[0] > streams["c"].token_times()[-1]
        assert second.token_times()[0] > first.token_times()[-1]
        assert watch.running[:3] == [4, 3, 2]
        assert max(watch.running) == 4


async def test_raising_max_num_seqs_admits_at_the_next_step(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Cap 1 -> 2 just after A's k-th token: the waiting request joins the step that
    starts at the next boundary, priced as A's decode plus its prefill."""
    settings = make_settings(max_num_seqs=1)
    dep = settings.deployments[0]
    k = 3
    async with serve(settings) as s:
        async with s.stream(chat_body(max_tokens=20, stream=True)) as a:
            await fill_batch(a)
            async with s.stream(chat_body(max_tokens=3, stream=True)) as w:
                await w.next_chunk()  # role frame: admitted, waiting
                while len(a.token_times()) < k:
                    await a.next_chunk()
                assert s.runtime().snapshot().depth == 1
                await s.post("/control/capacity", {"max_num_seqs": 2})
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(a.read_all)
                    nursery.start_soon(w.read_all)
    roof = Roofline(dep)
    joint = roof.step_time(np.array([1, P]), np.array([P + k, 0]))
    assert w.token_times()[0] == pytest.approx(a.token_times()[k] + joint, abs=1e-12)


async def test_capacity_changes_show_at_once_on_an_idle_server(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(GPT, LLAMA)) as s:
        response = await s.post("/control/capacity", {"max_num_seqs": 7, "max_waiting": 3})
        assert response.status_code == 200
        expected = [
            {
                "model": name,
                "max_waiting": 3,
                "max_num_seqs": 7,
                "waiting": 0,
                "queued": 0,
                "running": 0,
            }
            for name in (GPT, LLAMA)
        ]
        assert json.loads(await response.get_data()) == expected
        assert await s.get_json("/control/capacity") == (200, expected)
        assert s.runtime(LLAMA).engine.max_num_seqs == 7
        response = await s.post("/control/capacity", {"model": LLAMA, "max_num_seqs": 2})
        assert json.loads(await response.get_data()) == [
            {
                "model": LLAMA,
                "max_waiting": 3,
                "max_num_seqs": 2,
                "waiting": 0,
                "queued": 0,
                "running": 0,
            }
        ]
        response = await s.post("/control/capacity", {})
        assert [e["max_num_seqs"] for e in json.loads(await response.get_data())] == [7, 2]


async def test_capacity_get_shape(serve: ServeFactory) -> None:
    async with serve(make_settings(max_waiting=64)) as s:
        status, body = await s.get_json("/control/capacity")
    assert status == 200
    assert body == [
        {
            "model": GPT,
            "max_waiting": 64,
            "max_num_seqs": 256,
            "waiting": 0,
            "queued": 0,
            "running": 0,
        }
    ]
    assert list(body[0]) == ["model", "max_waiting", "max_num_seqs", "waiting", "queued", "running"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"max_num_seqs": 1.5}, "max_num_seqs"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"max_waiting": -1}, "max_waiting"),
        ({"max_waiting": 2.0}, "max_waiting"),
        ({"max_num_seqs": 8, "max_waiting": -1}, "max_waiting"),
        ({"model": 5}, "model"),
        ({"max_num_seqs": 8, "extra": 1}, "extra"),
    ],
)
async def test_invalid_capacity_change_is_400_and_changes_nothing(
    serve: ServeFactory, body: dict[str, Any], param: str
) -> None:
    async with serve(make_settings(max_waiting=9)) as s:
        response = await s.post("/control/capacity", body)
        assert response.status_code == 400
        error = json.loads(await response.get_data())["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "invalid_value",
            param,
            "invalid_request_error",
        )
        _, after = await s.get_json("/control/capacity")
        assert (after[0]["max_num_seqs"], after[0]["max_waiting"]) == (256, 9)


async def test_capacity_body_must_be_a_json_object(serve: ServeFactory) -> None:
    async with serve() as s:
        for raw in (b"[1]", b"nope"):
            response = await s.post_raw("/control/capacity", raw)
            assert response.status_code == 400
            assert json.loads(await response.get_data())["error"]["code"] == "invalid_json"


async def test_capacity_for_an_unknown_model_is_404_and_changes_nothing(
    serve: ServeFactory,
) -> None:
    async with serve() as s:
        response = await s.post("/control/capacity", {"model": "x", "max_num_seqs": 3})
        assert response.status_code == 404
        error = json.loads(await response.get_data())["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        _, after = await s.get_json("/control/capacity")
        assert after[0]["max_num_seqs"] == 256


def test_pending_slots_are_given_back_exactly_once(autojump_clock: Any) -> None:
    """A request that leaves before the engine steps it gives its pending slot back at
    once; closing again, or after it was stepped, never drives pending below zero; a
    failed send into a dead engine gives the slot back and answers 503."""

    async def main() -> None:
        rt = ModelRuntime(make_settings(max_waiting=2).deployments[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            a = rt.admit_nowait(prompt_tokens=5, max_tokens=2, priority=0, sink=NullSink())
            b = rt.admit_nowait(prompt_tokens=5, max_tokens=2, priority=0, sink=NullSink())
            assert rt.snapshot().pending == 2
            a.close()
            a.close()
            assert rt.snapshot().pending == 1
            # the freed slot admits another at once, before the engine ran
            c = rt.admit_nowait(prompt_tokens=5, max_tokens=2, priority=0, sink=NullSink())
            await trio.testing.wait_all_tasks_blocked()
            assert rt.snapshot().pending == 0
            b.close()
            c.close()
            assert rt.snapshot().pending == 0 and rt.snapshot().depth == 0
            rt._inbox_recv.close()  # the engine task is gone, the flag not yet down
            with pytest.raises(EngineUnavailable):
                rt.admit_nowait(prompt_tokens=5, max_tokens=2, priority=0, sink=NullSink())
            assert rt.snapshot().pending == 0
            assert rt.engine.statistics().aborted == 2
            rt.stop()

    trio.run(main, clock=autojump_clock)


def test_a_handle_is_alone_while_its_runtime_holds_nothing_else(autojump_clock: Any) -> None:
    """``RequestHandle.alone`` (the completion route's test for an idle engine): true for
    the only admitted request, queued or running, false beside another, true again once
    the other is done, and false once it is done itself."""

    async def main() -> None:
        rt = ModelRuntime(make_settings().deployments[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.run)
            a = rt.admit_nowait(prompt_tokens=5, max_tokens=50, priority=0, sink=NullSink())
            assert a.alone  # queued, not yet taken
            await trio.testing.wait_all_tasks_blocked()
            assert a.state == "submitted" and a.alone
            b = rt.admit_nowait(prompt_tokens=5, max_tokens=50, priority=0, sink=NullSink())
            assert not a.alone and not b.alone
            a.close()
            assert b.alone
            b.close()
            assert not b.alone
            rt.stop()

    trio.run(main, clock=autojump_clock)
