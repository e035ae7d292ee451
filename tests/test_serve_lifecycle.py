"""Resources come back: a client that leaves (waiting, prefilling, decoding; streaming or
not) frees its queue slot, batch slot and KV blocks; an engine crash stops only its model,
ends its streams with the engine_failed frame and answers 503 from then on.

The disconnect tests run through the in-memory client and through a real socket (the
``serve_both`` fixture: there the client closes its connection and the transport's close
watch tells the request), on the real clock with the engine's steps priced at
:data:`SLOW` times the model's, so a request is still running when its client leaves.
"""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing

from tests.conftest import GPT, LLAMA, ServeFactory, chat_body, make_settings
from tests.serve_util import assert_idle

#: The step-time factor of the disconnect tests on the real clock (a decode step of
#: gpt-oss-20b on b200 then takes ~10 ms).
SLOW = 20.0


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_disconnect_while_waiting_leaves_the_queue(serve_both: ServeFactory) -> None:
    async with serve_both(make_settings(max_num_seqs=1)) as s:
        rt = s.runtime()
        rt.set_step_time_factor(SLOW)
        async with s.stream(chat_body(max_tokens=50, stream=True)) as a:
            await a.next_chunk()  # role frame: admitted
            async with s.stream(chat_body(max_tokens=50, stream=True)) as b:
                await b.next_chunk()
                await settle()
                assert (rt.snapshot().running, rt.snapshot().depth) == (1, 1)
                await b.disconnect()
                await settle()
                assert (rt.snapshot().running, rt.snapshot().depth) == (1, 0)
            await a.read_all()
        await settle()
        assert_idle(rt)
        assert rt.engine.statistics().aborted == 1


async def test_disconnect_while_prefilling_frees_blocks_at_once(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A 4000-token prompt's prefill step is in flight when the client leaves: its KV
    blocks and batch slot are free before that step ends."""
    async with serve() as s:
        rt = s.runtime()
        async with s.stream(chat_body("x" * 16000, max_tokens=10, stream=True)) as a:
            await a.next_chunk()
            await settle()
            st = rt.engine.statistics()
            assert st.running == 1 and st.kv_used_blocks > 60
            t = trio.current_time()
            await a.disconnect()
            await settle()
            assert trio.current_time() == t
            assert_idle(rt)
            assert a.token_times() == []


async def test_disconnect_while_decoding_frees_blocks(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        rt = s.runtime()
        rt.set_step_time_factor(SLOW)
        async with s.stream(chat_body(max_tokens=100, stream=True)) as a:
            while len(a.token_times()) < 3:
                await a.next_chunk()
            assert rt.engine.statistics().kv_used_blocks > 0
        await settle()
        assert_idle(rt)
        assert rt.engine.statistics().finished == 0


async def test_non_streaming_disconnect_aborts_the_request(serve_both: ServeFactory) -> None:
    async with serve_both() as s:
        rt = s.runtime()
        rt.set_step_time_factor(SLOW)
        async with s.stream(chat_body(max_tokens=100)) as a:
            await settle()
            assert rt.snapshot().running == 1
            await a.disconnect()
            await settle()
            assert_idle(rt)
            assert a.status is None  # nothing was sent


async def test_disconnected_waiting_request_frees_its_queue_slot_for_another(
    serve_both: ServeFactory,
) -> None:
    """max_waiting = 1: a second waiter is refused while the first waits, admitted once
    the first has left."""
    async with serve_both(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        s.runtime().set_step_time_factor(SLOW)
        async with s.stream(chat_body(max_tokens=50, stream=True)) as running:
            await running.next_chunk()
            await settle()
            async with s.stream(chat_body(max_tokens=5, stream=True)) as waiting:
                await waiting.next_chunk()
                refused = await s.post("/v1/chat/completions", chat_body())
                assert refused.status_code == 529
            await settle()
            async with s.stream(chat_body(max_tokens=5, stream=True)) as again:
                await again.next_chunk()
                assert again.status == 200
                await running.read_all()
                await again.read_all()
            assert again.frames()[-1] == b"[DONE]"
        await settle()
        assert_idle(s.runtime())


async def test_many_disconnects_leak_nothing(serve_both: ServeFactory) -> None:
    """Twenty streams, each leaving at a different point, over a small batch cap."""
    async with serve_both(make_settings(max_num_seqs=3)) as s:

        async def client(i: int) -> None:
            async with s.stream(chat_body(max_tokens=30, stream=True)) as st:
                while len(st.token_times()) < i % 7:
                    if await st.next_chunk() is None:
                        break

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(client, i)
        await settle()
        assert_idle(s.runtime())


# -- engine failure ---------------------------------------------------------------------------


class Boom(Exception):
    pass


class CrashingEngine:
    """Wraps an Engine; once armed, ``step()`` raises (the runtime's test hook: the
    runtime's ``engine`` attribute may be replaced)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> Any:
        if self.armed:
            raise Boom("injected")
        return self._engine.step()


async def test_engine_crash_fails_its_model_only(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(make_settings(GPT, LLAMA)) as s:
        rt = s.runtime(GPT)
        crashing = CrashingEngine(rt.engine)
        rt.engine = crashing  # type: ignore[assignment]
        async with (
            s.stream(chat_body(max_tokens=100, stream=True)) as streaming,
            s.stream(chat_body(max_tokens=100)) as blocking,
        ):
            while len(streaming.token_times()) < 2:
                await streaming.next_chunk()
            crashing.armed = True
            await streaming.read_all()
            await blocking.read_all()
        payloads = streaming.frames()
        assert payloads[-1] == b"[DONE]"
        error = json.loads(payloads[-2])
        assert error == {
            "error": {
                "message": f"The engine for model '{GPT}' failed: Boom: injected",
                "type": "server_error",
                "param": None,
                "code": "engine_failed",
            }
        }
        assert all(b"finish_reason" not in p for p in payloads)
        assert blocking.status == 500
        assert json.loads(blocking.body_bytes())["error"]["code"] == "engine_failed"

        response = await s.post("/v1/chat/completions", chat_body())
        assert response.status_code == 503
        assert json.loads(await response.get_data())["error"]["code"] == "engine_unavailable"
        status, health = await s.get_json("/health")
        assert status == 503
        assert health == {"status": "unavailable", "models": {GPT: "stopped", LLAMA: "running"}}
        response = await s.post("/v1/chat/completions", chat_body(model=LLAMA, max_tokens=3))
        assert response.status_code == 200
        snap = rt.snapshot()
        assert (snap.alive, snap.pending, snap.depth) == (False, 0, 0)


async def test_dead_engine_answers_503_before_the_depth_check(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A stopped engine whose batch and queue were full answers 503, never 529, and
    reports nothing running or waiting (its gauges are not left stale)."""
    async with serve(make_settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime()
        async with (
            s.stream(chat_body(max_tokens=50, stream=True)) as running,
            s.stream(chat_body(max_tokens=50, stream=True)) as waiting,
        ):
            await running.next_chunk()
            await trio.testing.wait_all_tasks_blocked()
            assert (rt.snapshot().running, rt.snapshot().depth) == (1, 1)
            response = await s.post("/v1/chat/completions", chat_body())
            assert response.status_code == 529
            rt.stop()
            await running.read_all()
            await waiting.read_all()
        response = await s.post("/v1/chat/completions", chat_body())
        assert response.status_code == 503
        status, body = await s.get_json("/control/capacity")
        assert (body[0]["waiting"], body[0]["queued"], body[0]["running"]) == (0, 0, 0)
